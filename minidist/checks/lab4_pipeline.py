"""Reusable checks for the pipeline lab (lab 4): schedules, an executor, bubble and memory.

One call runs a student's function, compares it with
the library (:mod:`minidist.pipeline`) and with single-process autograd, and raises
``AssertionError`` saying in words what is wrong. A lab test cell is a one-liner::

    checks_pipeline.check_schedule(gpipe_schedule, "gpipe")
    checks_pipeline.check_executor(run_pipeline, hidden=True)

* :func:`check_schedule` (:mod:`minidist.checks.lab4_schedules`, re-exported here; the lab's
  refusal is defined there too) is pure Python (no ranks): the schedule must pass the validator
  (:func:`minidist.pipeline.validate`, deadlock included), have the canonical compute
  order, and its simulated bubble and peak activations must equal the formulas of
  :mod:`minidist.cost` exactly.
* :func:`check_executor` runs the student's executor on the *library's* schedules (so a
  schedule bug cannot fail it) and compares every rank's gradients and the loss with
  single-process training, within 1e-5.
* :func:`check_executor_memory` measures what autograd really keeps alive on every rank
  (saved-tensor hooks around each stage, not the executor's own bookkeeping): GPipe must
  peak at m micro-batches, 1F1B at min(p - rank, m), each of one micro-batch's size. Its
  bubble is graded from what load cannot change: each rank's traced order of computes,
  sends and receive-waits, replayed at fixed costs
  (:func:`minidist.pipeline.replayed_slots`), must give the simulator's bubble exactly.
  A wall-clock bubble is only measured for the lab's plots: on a loaded 2-core machine it
  moves by several points from run to run.

A deadlocking executor fails after ``timeout`` seconds with the launcher's diagnosis
(which rank is blocked in which operation, on which line).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT, launch_named, mark_case, report_passed
from minidist.checks.kit.docket import Judged, from_raising, judged
from minidist.checks.lab4_cases import (EXECUTOR_CASES, WIDTH, Case, _compare_step, _inputs, _rank_grads,  # noqa: F401
                                        _schedule)
from minidist.checks.lab4_schedules import (JUDGED_SCHEDULE, REFUSED, SCHEDULE_CASES, Schedule,  # noqa: F401
                                            check_schedule)
from minidist.checks.kit.quiet import passes_quietly
from minidist.cost import pipeline_bubble, pipeline_peak_activations
from minidist.harness.pipeline import kept_at_each_backward
from minidist.memory import ActivationMeter, Metered
from minidist.models import block_stack, regression_batch
from minidist.pipeline import (Costs, bubble_of, make, partition, rank_chunks, replayed_slots, simulate,
                               slots_from_trace)
from minidist.trace import merge, trace

SLEEP = Costs(F=0.02, B=0.04)        # seconds per action in sleep-compute mode


# ----------------------------------------------------------------------------- executor
def _executor_equal(run, answer) -> None:
    """Every rank's losses and gradients of a run (world, cases) against single-process autograd."""
    (world, cases), name, results = run, answer["name"], answer["results"]
    for i, case in enumerate(cases):
        kind, m, batch, p = case.kind, case.m, case.batch, case.p or world
        where = f"{name} with {kind}(p={p}, m={m}), batch of {batch}" + (
            "" if case.dtype == torch.float32 else f" in {case.dtype}")
        model, x, y = _inputs(p, case)
        ref_loss = F.mse_loss(model(x), y)
        ref_loss.backward()
        stages = partition(model, p)
        for r in range(p):
            for step, (loss, grads, changed) in enumerate(results[r][i]):
                at = where if step == 0 else f"{where}, step 2 (the same schedule object again)"
                if changed:
                    raise AssertionError(f"{at}: on rank {r}, {changed}")
                want = [q.grad for q in rank_chunks(stages, p, r)[0].parameters()]
                _compare_step(at, r, p, m, loss, grads, want, ref_loss.item())


# Judged (minidist.checks.kit.docket): the child files every rank's results; the grader's judge compares again.
JUDGED_EXECUTOR = Judged(__name__, "executor", lambda hidden: list(EXECUTOR_CASES[hidden].items()),
                         from_raising(_executor_equal))


@judged(JUDGED_EXECUTOR)
@passes_quietly
def check_executor(fn, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT, name: str | None = None) -> None:
    """``fn(schedule, chunks, x, y)`` runs one step's forwards and backwards of the library's
    GPipe and 1F1B schedules (the first case of each launch twice with the same schedule object);
    gradients on every rank and the loss (returned by the rank holding the last stage, None
    elsewhere) must equal single-process autograd's at every step, and the schedule, the batch
    and the weights stay as the caller gave them. Hidden: p = 3, m not a multiple of p, fp64, and p = 1 (one stage,
    run on rank 0 of the 3-rank launch)."""
    name = name or getattr(fn, "__name__", "executor")

    def launched(run):
        world, cases = run
        schedules = {(c.kind, c.m, c.p or world): _schedule(c.kind, c.p or world, c.m) for c in cases}   # outside the refusal
        return {"name": name, "results": launch_named(_rank_grads, world, fn, cases, schedules, name=name,
                                                      timeout=timeout, refuse=REFUSED)}
    JUDGED_EXECUTOR.run(dict(hidden=hidden), launched)
    sizes = sorted({c.p or w for w, cs in EXECUTOR_CASES[hidden].items() for c in cs})
    dtypes = "fp32/fp64" if any(c.dtype != torch.float32 for cs in EXECUTOR_CASES[hidden].values() for c in cs) else "fp32"
    report_passed(name, f"p = {', '.join(map(str, sizes))}, GPipe and 1F1B, {dtypes}: gradients and loss vs one "
                        f"process, a schedule run twice, schedule, batch and weights untouched", hidden)


# ----------------------------------------------------------------------------- memory, bubble
def _stage(p, rank):
    return rank_chunks(partition(block_stack(p, WIDTH), p), p, rank)[0]


def _rank_memory(progress, fn, cases, costs, repeats, schedules):
    rank, p, out = dist.get_rank(), dist.get_world_size(), []
    for kind, m, batch in cases:
        mark_case(progress, str(Case(kind, m, batch)))
        stage = _stage(p, rank)
        meter = ActivationMeter(stage.parameters())
        x, y = regression_batch(batch, WIDTH)
        _, finished = kept_at_each_backward(lambda c: fn(copy.deepcopy(schedules[kind, m]), c, x, y),
                                        [Metered(stage, meter)], ignore=(x, y))
        one = ActivationMeter(stage.parameters())        # one micro-batch, alone
        with torch.autograd.graph.saved_tensors_hooks(one.pack, one.unpack):
            kept = stage(x.chunk(m)[0].clone().requires_grad_())
        del kept
        bubbles = []
        for _ in range(repeats):
            dist.barrier()
            with trace() as t:
                fn(copy.deepcopy(schedules[kind, m]), [stage], x, y, costs=costs)
            bubbles.append(t)
        out.append((meter.peak_calls, meter.peak_bytes, one.peak_bytes, bubbles, finished))
    return out


@passes_quietly
def measure_executor(fn, p: int, cases, costs: Costs = SLEEP, repeats: int = 1, timeout: float = TRAINING_CHECK_TIMEOUT,
                     name: str | None = None, sleep: bool = True) -> list[dict]:
    """Run ``fn`` on p ranks for each (schedule, m, batch) in ``cases``: measured peak
    activations (micro-batches and bytes) per rank; the bubble of a sleep-compute run
    (``measured``: the smallest of ``repeats``, whose timeline is ``slots``; None without
    ``sleep``); and ``replayed``, the bubble of the run's traced order replayed at ``costs``,
    which load does not change; ``kept``, per rank, at each backward, how many finished
    micro-batches still had their stage input or output alive
    (:func:`minidist.harness.pipeline.kept_at_each_backward`). One dict per case, with the theory
    and the simulator's bubble next to it (keys as ``minidist.plots.plot_bubble_vs_m`` wants them).
    Outputs land as the backend writes them here (no ``outputs_at_wait``: its handles would keep the
    receive buffers alive); :func:`check_executor` checks the waits."""
    name = name or getattr(fn, "__name__", "executor")
    return _measured_rows(_launch_memory(fn, p, cases, costs, repeats, sleep, timeout, name), p, cases, costs,
                          repeats, sleep)


def _launch_memory(fn, p, cases, costs, repeats, sleep, timeout, name) -> list:
    """Every rank's :func:`_rank_memory` results for ``cases``, on p ranks."""
    schedules = {(kind, m): _schedule(kind, p, m) for kind, m, _ in cases}       # built outside the refusal
    return launch_named(_rank_memory, p, fn, cases, costs if sleep else None, repeats, schedules, name=name,
                        timeout=timeout, refuse=REFUSED, outputs_at_wait=False)


def _measured_rows(results, p, cases, costs: Costs, repeats: int, sleep: bool) -> list[dict]:
    """:func:`measure_executor`'s rows from every rank's results (as plain data)."""
    rows = []
    for i, (kind, m, batch) in enumerate(cases):
        measured, timelines, replayed = [], [], None
        for k in range(repeats):
            merged = merge(results[r][i][3][k] for r in range(p))
            slots = slots_from_trace(merged)
            measured.append(bubble_of(slots, p) if slots and sleep else None)
            timelines.append(slots)
            if k == 0 and slots:
                replayed = bubble_of(replayed_slots(merged, costs), p)
        rows.append(dict(schedule=kind, p=p, m=m, batch=batch,
                         peak_microbatches=[results[r][i][0] for r in range(p)],
                         peak_bytes=[results[r][i][1] for r in range(p)],
                         microbatch_bytes=[results[r][i][2] for r in range(p)],
                         kept=[results[r][i][4] for r in range(p)],
                         theory_microbatches=[pipeline_peak_activations(kind, p, m, r) for r in range(p)],
                         measured=None if None in measured else min(measured),
                         slots=timelines[measured.index(min(measured))] if None not in measured else timelines[0],
                         replayed=replayed,
                         simulated=simulate(make(kind, p, m), costs).bubble,
                         theory=pipeline_bubble(kind, p, m, t_f=costs.F, t_b=costs.B)))
    return rows


KEPT_SLACK = 1      # finished micro-batches a stage may still hold when a backward begins (a loop variable)


def _check_kept(where, row, p, m):
    """Between micro-batches a stage holds what the schedule has in flight (and what it has sent):
    a micro-batch whose backward has run must let go of its stage input (a received buffer) and output."""
    act = row["batch"] // m * WIDTH * 4
    for r in range(p):
        kept = row["kept"][r]
        if kept and max(kept) > KEPT_SLACK:
            k = kept.index(max(kept))
            mb = [a.mb for a in make(row["schedule"], p, m).compute(r) if a.kind == "B"][k]
            raise AssertionError(
                f"{where}: when the backward of micro-batch {mb} began, rank {r} still held the stage input or "
                f"output of {max(kept)} micro-batches whose backward had already run (~{max(kept) * act} bytes of "
                f"activations; {row['schedule']} needs at most {row['theory_microbatches'][r]} micro-batches in "
                f"flight on this rank). Forget each micro-batch's stage input (its receive buffer) and output "
                f"once its backward has run.")


def _memory_cases(m: int) -> list[tuple]:
    return [("gpipe", m, 4 * m), ("1f1b", m, 4 * m)]


def _executor_memory(run, answer) -> None:
    """The activations, what is kept and the replayed bubble of every rank's run (p = 4, m = 8)."""
    p, m = run
    name = answer["name"]
    rows = _measured_rows(answer["results"], p, _memory_cases(m), SLEEP, 1, False)
    for row in rows:
        where = f"{name} with {row['schedule']}(p={p}, m={m})"
        if row["peak_microbatches"] != row["theory_microbatches"]:
            raise AssertionError(f"{where}: autograd held the activations of {row['peak_microbatches']} "
                                 f"micro-batches at the peak (per rank); {row['schedule']} needs "
                                 f"{row['theory_microbatches']}. Drop every reference to a micro-batch's "
                                 f"stage input and output once its backward has run.")
        for r in range(p):
            want = row["theory_microbatches"][r] * row["microbatch_bytes"][r]
            if row["peak_bytes"][r] != want:
                raise AssertionError(f"{where}: rank {r} held {row['peak_bytes'][r]} bytes of activations at "
                                     f"the peak; {row['theory_microbatches'][r]} micro-batches of "
                                     f"{row['batch'] // m} rows hold {want}. Is every micro-batch 1/m of the batch?")
        _check_kept(where, row, p, m)
        if row["replayed"] is None:
            raise AssertionError(f"{where}: no compute was recorded on the timeline. "
                                 f"Run every F and B inside `with timed(action, costs):`.")
        if abs(row["replayed"] - row["simulated"]) > 1e-9:
            raise AssertionError(f"{where}: your run, replayed in its own order with F={SLEEP.F}s and B={SLEEP.B}s "
                                 f"and free messages, has a bubble of {row['replayed']:.3f}; the schedule's is "
                                 f"{row['simulated']:.3f}. Do ranks wait for messages they do not need yet, "
                                 f"synchronise more than the schedule asks, or compute out of the schedule's order?")


JUDGED_MEMORY = Judged(__name__, "executor memory", lambda: [(4, 8)], from_raising(_executor_memory), params=())


@judged(JUDGED_MEMORY)
@passes_quietly
def check_executor_memory(fn, timeout: float = TRAINING_CHECK_TIMEOUT, name: str | None = None) -> None:
    """On 4 ranks with m = 8: the activations autograd holds peak at m micro-batches per
    rank for GPipe and at min(p - rank, m) for 1F1B, each the size of one micro-batch's; each
    time a backward begins, at most ``KEPT_SLACK`` finished micro-batches still have their stage
    input (a receive buffer) or output alive; and the run's traced order, replayed at fixed costs, has the schedule's simulated
    bubble (p-1)/(m+p-1) exactly, whatever the load on the machine."""
    name = name or getattr(fn, "__name__", "executor")
    p, m = 4, 8
    JUDGED_MEMORY.run({}, lambda run: {"name": name, "results": _launch_memory(fn, p, _memory_cases(m), SLEEP, 1, False,
                                                                             timeout, name)})
    report_passed(name, f"p = {p}, m = {m}, GPipe and 1F1B: activations per rank = theory, nothing kept "
                        f"after its backward, replayed bubble = the schedule's")
