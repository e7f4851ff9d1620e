"""Lab 4's answers: what the student's schedule builders return, and what their executor does on
every rank (the only code of this lab's checks that calls student code).

What must come back unchanged (the schedule, the batch, the weights) travels as digests; the verdicts
(``verdicts.py``) compare them with the inputs they rebuild.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from minidist.checks.kit.compare import digest
from minidist.checks.kit.returned import returned
from minidist.checks.kit.run import mark
from minidist.checks.lab4_pipeline.cases import SCHEDULE_FUNCTION, WIDTH, rank_inputs, schedule_state, stage
from minidist.harness.pipeline import kept_at_each_backward
from minidist.memory import ActivationMeter, Metered
from minidist.models import regression_batch
from minidist.trace import trace


def schedule(fn, case) -> dict:
    """In this process: the schedule ``fn(p, m)`` built, recorded by the kit's ``returned`` (an object of the
    student's own class is not read: it would run its code in the verdict)."""
    kind, p, m = case
    return returned(fn(p, m), f"{SCHEDULE_FUNCTION[kind]}(p={p}, m={m})")


# ----------------------------------------------------------------------------- executor
def _params(chunks):
    return [q for c in chunks for q in c.parameters()]


def _given(schedule_, x, y, chunks) -> dict:
    """What the caller owns, as the step must leave it: the schedule's state, digests of the batch and weights."""
    return {"schedule": schedule_state(schedule_), "x": digest(x), "y": digest(y),
            "weights": [digest(q) for q in _params(chunks)]}


def executor(fn, case, reference) -> list:
    """On every rank of a launch ``case`` = (world, runs): per run, its step (the first run's twice,
    with the same schedule object and the gradients cleared between), each step's loss, gradients
    and what it left of the schedule, the batch and the weights; None for a run on fewer stages
    than this rank's. ``reference``: the library's schedules, built on this rank before (outside
    the refusal)."""
    world, runs = case
    rank, out = dist.get_rank(), []
    for i, run in enumerate(runs):
        p = run.p or world
        if rank >= p:                       # a run on fewer stages than ranks: this rank sits it out
            out.append(None)
            continue
        mark(str(run))
        chunks, x, y = rank_inputs(p, run, rank)
        schedule_ = reference[run.kind, p, run.m]
        given, steps = _given(schedule_, x, y, chunks), []
        for _ in range(2 if i == 0 else 1):
            for q in _params(chunks):
                q.grad = None
            loss = fn(schedule_, chunks, x, y)
            loss = float(loss) if isinstance(loss, torch.Tensor) else loss
            grads = [None if q.grad is None else q.grad.detach().to("cpu", copy=True) for q in _params(chunks)]
            left = _given(schedule_, x, y, chunks)
            steps.append({"loss": loss, "grads": grads, **left})
            if left != given:              # a second step on a consumed schedule could only hang
                break
        out.append(steps)
    return out


# ----------------------------------------------------------------------------- memory and bubble
def memory(fn, case, reference) -> list:
    """On every rank of the memory launch ``case`` = (p, runs): :func:`memory_runs` without sleeping
    (the bubble is graded from the traced order, replayed at fixed costs)."""
    return memory_runs(fn, case[1], None, 1, reference, mark)


def memory_runs(fn, runs, costs, repeats: int, schedules: dict, mark_run) -> list:
    """Inside a rank: per run (kind, m, batch), the activations autograd held at the peak (micro-batches
    and bytes, saved-tensor hooks around the stage), one micro-batch's bytes alone, the traces of
    ``repeats`` runs at ``costs`` (None: no sleeping), and, at each backward, how many finished
    micro-batches still had their stage input or output alive. ``mark_run(text)`` names the running
    run (the check's :func:`~minidist.checks.kit.run.mark`, or the demo's own)."""
    rank, p, out = dist.get_rank(), dist.get_world_size(), []
    for run in runs:
        mark_run(str(run))
        stage_ = stage(p, rank)
        meter = ActivationMeter(stage_.parameters())
        x, y = regression_batch(run.batch, WIDTH)
        given = schedules[run.kind, p, run.m]
        _, finished = kept_at_each_backward(lambda c: fn(copy.deepcopy(given), c, x, y),
                                            [Metered(stage_, meter)], ignore=(x, y))
        one = ActivationMeter(stage_.parameters())        # one micro-batch, alone
        with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
            kept = stage_(x.chunk(run.m)[0].clone().requires_grad_())
        del kept
        traces = []
        for _ in range(repeats):
            dist.barrier()
            with trace() as t:
                fn(copy.deepcopy(given), [stage_], x, y, costs=costs)
            traces.append(t)
        out.append((meter.peak_calls, meter.peak_bytes, one.peak_bytes, traces, finished))
    return out
