"""Lab 4's checks (pipeline parallelism): the student's GPipe and 1F1B schedules, the executor's
gradients, and what the executor holds and waits for.

Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (1F1B). A schedule is data, as in
``torch.distributed.pipelining``: per rank, a list of forward, backward, send and receive actions.
A test cell is a one-liner::

    checks.check_schedule(gpipe_schedule, "gpipe")          # in this process, against the theory
    checks.check_executor(run_pipeline, hidden=True)         # on 2-4 ranks, against one process
    checks.check_executor_memory(run_pipeline)               # on 4 ranks: activations, replayed bubble
    checks.check_device(run_pipeline)                        # no tensor made off the batch's device

* ``check_schedule``: the schedule passes the validator (:func:`minidist.pipeline.validate`, deadlock
  included), has the kind's canonical compute order, and its simulated bubble (p-1)/(m+p-1) and peak
  activations (m for GPipe, min(p - rank, m) for 1F1B) equal the formulas of :mod:`minidist.cost`.
* ``check_executor`` runs the student's executor on the *library's* schedules (a schedule bug cannot
  fail it): every rank's gradients and the loss equal single-process autograd's within 1e-5, the first
  run of each launch twice with the same schedule object, and the schedule, the batch and the weights
  come back as given.
* ``check_executor_memory`` measures what autograd keeps alive on every rank (saved-tensor hooks around
  each stage): the theory's peak micro-batches, nothing kept after its backward, and the run's traced
  order replayed at fixed costs (:func:`minidist.pipeline.replayed_slots`) has the simulator's bubble
  exactly, whatever the machine's load. A wall-clock bubble is only measured for the lab's plots
  (``measure_executor``, ``demo.py``).

A deadlocking executor fails after ``timeout`` seconds with the launcher's diagnosis. The cases are in
``cases.py``, the code that runs the student's functions in ``answers.py``, the comparisons in
``verdicts.py`` (docs/AUTHORING.md).
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import Registry
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT
from minidist.checks.lab4_pipeline import answers, cases, verdicts
from minidist.checks.lab4_pipeline.cases import REFUSED
from minidist.checks.lab4_pipeline.demo import measure_executor

#: what a notebook reads: the test cells' checks, the demo cells' measurement
__all__ = ["CHECKS", "REFUSED", "check_schedule", "check_executor", "check_executor_memory", "check_device",
           "measure_executor"]
CHECKS = Registry(__name__)
_ON_RANKS = dict(where="launch", world=lambda case: case[0], refusal=REFUSED, title="run_pipeline")

SCHEDULES = {kind: CHECKS.check(f"{kind} schedule", partial(cases.schedule_cases, kind), answers.schedule,
                                verdicts.schedule, title=function, refusal=REFUSED,
                                covered=partial(cases.schedule_covered, kind))
             for kind, function in cases.SCHEDULE_FUNCTION.items()}
EXECUTOR = CHECKS.check("executor", cases.executor_cases, answers.executor, verdicts.executor,
                        covered=cases.executor_covered, launch={"reference": cases.schedules}, **_ON_RANKS)
MEMORY = CHECKS.check("executor memory", cases.memory_cases, answers.memory, verdicts.memory, params=(),
                      covered=cases.memory_covered, launch={"reference": cases.schedules, "outputs_at_wait": False},
                      **_ON_RANKS)
DEVICE = on_meta(EXECUTOR)


@CHECKS.entry(SCHEDULES, by="kind")
def check_schedule(fn, kind: str, hidden: bool = False, name: str | None = None) -> None:
    """``fn(p, m)`` must return a valid ``kind`` schedule ("gpipe" or "1f1b"): validator
    clean (deadlock included), canonical compute order, simulated bubble = theory and
    simulated peak activations per rank = theory."""


@CHECKS.entry(EXECUTOR)
def check_executor(fn, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT, name: str | None = None) -> None:
    """``fn(schedule, chunks, x, y)`` runs one step's forwards and backwards of the library's
    GPipe and 1F1B schedules (the first case of each launch twice with the same schedule object);
    gradients on every rank and the loss (returned by the rank holding the last stage, None
    elsewhere) must equal single-process autograd's at every step, and the schedule, the batch
    and the weights stay as the caller gave them; p = 1 (one stage, run on rank 0 of the 2-rank launch). Hidden:
    p = 3, m not a multiple of p, fp64, and p = 1 on rank 0 of the 3-rank launch."""


@CHECKS.entry(MEMORY)
def check_executor_memory(fn, timeout: float = TRAINING_CHECK_TIMEOUT, name: str | None = None) -> None:
    """On 4 ranks with m = 8: the activations autograd holds peak at m micro-batches per
    rank for GPipe and at min(p - rank, m) for 1F1B, each the size of one micro-batch's; each
    time a backward begins, at most ``verdicts.KEPT_SLACK`` finished micro-batches still have their stage
    input (a receive buffer) or output alive; and the run's traced order, replayed at fixed costs, has the
    schedule's simulated bubble (p-1)/(m+p-1) exactly, whatever the load on the machine."""


@CHECKS.entry(DEVICE)
def check_device(fn, timeout: float = TRAINING_CHECK_TIMEOUT, name: str | None = None) -> None:
    """Where the executor's tensors live: the gradient check's first visible case, run with torch's
    default device ``meta`` in every rank (kit/device_check.py). A tensor made without ``device=`` (a
    receive buffer) fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
