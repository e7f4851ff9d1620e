"""``minidist tour`` rows for pipeline parallelism: one per schedule, on 4 ranks.

Each row trains one step of a residual-MLP stack with the schedule and compares every
rank's gradients with single-process autograd (max_err), counts the bytes each rank
sent against the activation/gradient traffic the schedule implies, and measures the
bubble in sleep-compute mode against the formula in :mod:`minidist.cost`.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F

from minidist.cost import pipeline_bubble
from minidist.models import block_stack, regression_batch
from minidist.pipeline import Costs, bubble_of, make, partition, rank_chunks, run_schedule, slots_from_trace
from minidist.runtime import launch, timed
from minidist.tour import TourEntry
from minidist.trace import merge, trace

P, M, WIDTH, BATCH = 4, 8, 16, 32
SLEEP = Costs(F=0.03, B=0.06)
ENTRIES = [("naive", 1, 1), ("gpipe", M, 1), ("1f1b", M, 1), ("interleaved", M, 2), ("zb-h1", M, 1)]


def _schedule(name, m, v):
    return make(name, P, m, v=v) if v > 1 else make(name, P, m)


def _rank(name, m, v):
    rank = dist.get_rank()
    x, y = regression_batch(BATCH, WIDTH)
    chunks = rank_chunks(partition(block_stack(2 * P * v, WIDTH), P * v), P, rank)
    with trace() as t:
        run_schedule(_schedule(name, m, v), chunks, x, y)
    grads = [q.grad.clone() for c in chunks for q in c.parameters()]
    sent = t.bytes_sent()
    sleep = Costs(F=SLEEP.F / v, B=SLEEP.B / v)
    dist.barrier()
    with trace() as t:
        run_schedule(_schedule(name, m, v), chunks, x, y, costs=sleep)
    return grads, sent, t


def _entry(name, m, v):
    def run():
        with timed() as elapsed:
            out = launch(_rank, P, name, m, v, timeout=120)
        model = block_stack(2 * P * v, WIDTH)
        x, y = regression_batch(BATCH, WIDTH)
        F.mse_loss(model(x), y).backward()
        stages = partition(model, P * v)
        err = max((g - q.grad).abs().max().item() for r in range(P)
                  for g, q in zip(out[r][0], (q for c in rank_chunks(stages, P, r) for q in c.parameters())))
        act = BATCH // m * WIDTH * 4          # bytes of one micro-batch activation (or its gradient)
        last = P * v - 1
        per_rank = [sum(m * act * ((s < last) + (s > 0)) for s in range(r, P * v, P)) for r in range(P)]
        measured = bubble_of(slots_from_trace(merge(o[2] for o in out)), P)
        c = Costs(F=SLEEP.F / v, B=SLEEP.B / v)
        theory = pipeline_bubble(name, P, m, v, t_f=c.F, t_b=c.B)
        label = name if v == 1 else f"{name} (v={v})"
        return {"technique": f"pipeline {label}, m={m}", "world_size": P, "max_err": err,
                "bytes_per_rank": max(o[1] for o in out), "bytes_theory": max(per_rank), "time_s": elapsed.seconds,
                "note": f"bubble measured {measured:.3f} vs theory {theory:.3f} (sleep-compute)",
                "bubble_measured": measured, "bubble_theory": theory}
    return run


def tour_entries():
    return [TourEntry(f"pipeline {n}" + (f" (v={v})" if v > 1 else ""), P, _entry(n, m, v))
            for n, m, v in ENTRIES]
