"""Lab 4's checks (pipeline parallelism): the student's GPipe and 1F1B schedules, the executor's
gradients, and what the executor holds and waits for.

Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (1F1B). A schedule is data, as in
``torch.distributed.pipelining``: per rank, a list of forward, backward, send and receive actions.
A test cell is a one-liner::

    checks.check_gpipe_schedule(gpipe_schedule)             # in this process, against the theory
    checks.check_run_pipeline(run_pipeline, hidden=True)      # on 2-4 ranks, against one process
    checks.check_run_pipeline_memory(run_pipeline)            # on 4 ranks: activations, replayed bubble
    checks.check_device(run_pipeline)                         # no tensor made off the batch's device

* ``check_gpipe_schedule``, ``check_one_f_one_b_schedule``: the schedule passes the validator (:func:`minidist.pipeline.validate`, deadlock
  included), has the kind's canonical compute order, and its simulated bubble (p-1)/(m+p-1) and peak
  activations (m for GPipe, min(p - rank, m) for 1F1B) equal the formulas of :mod:`minidist.cost`.
* ``check_run_pipeline`` runs the student's executor on the *library's* schedules (a schedule bug cannot
  fail it): every rank's gradients and the loss equal single-process autograd's within 1e-5, the first
  run of each launch twice with the same schedule object, and the schedule, the batch and the weights
  come back as given.
* ``check_run_pipeline_memory`` measures what autograd keeps alive on every rank (saved-tensor hooks around
  each stage): the theory's peak micro-batches, nothing kept after its backward, and the run's traced
  order replayed at fixed costs (:func:`minidist.pipeline.replayed_slots`) has the simulator's bubble
  exactly, whatever the machine's load. A wall-clock bubble is only measured for the lab's plots
  (``measure_executor``, ``demo.py``).

A deadlocking executor fails after the check's timeout (15 s) with the launcher's diagnosis. The cases are in
``cases.py``, the code that runs the student's functions in ``answers.py``, the comparisons in
``verdicts.py`` (docs/AUTHORING.md).
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab4_pipeline import answers, cases, demo, verdicts

#: what a notebook reads: the test cells' checks, the demo cells' measurement
__all__ = ["CHECKS", "REFUSED", "check_device", "check_gpipe_schedule", "check_one_f_one_b_schedule",
           "check_run_pipeline", "check_run_pipeline_memory", "measure_executor"]

#: minidist's schedule builders (make, gpipe, one_f_one_b, with_comms, ...) and executor (run_schedule)
#: are refused in graded code, and in the demo's launch; Action, Schedule and timed are the lab's building blocks.
REFUSED = Refusal("pipeline schedules and their executor",
                  ("minidist.pipeline.schedules", "minidist.pipeline.executor"),
                  allow=("minidist.pipeline.schedules.Action", "minidist.pipeline.schedules.Schedule",
                         "minidist.pipeline.executor.timed", "minidist.pipeline.executor.StepStats"), checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)
#: the executor's launches: 2-4 ranks, the library's schedules built on each before the student's code
_ON_RANKS = dict(where="launch", world=lambda case: case[0], function=cases.EXECUTOR_FUNCTION, timeout=15.0)

SCHEDULES = {kind: CHECKS.check(f"{kind}_schedule", partial(cases.schedule_cases, kind), answers.schedule,
                                verdicts.schedule, function=function, covered=partial(cases.schedule_covered, kind))
             for kind, function in cases.SCHEDULE_FUNCTION.items()}
EXECUTOR = CHECKS.check("run_pipeline_gradients", cases.executor_cases, answers.executor, verdicts.executor,
                        covered=cases.executor_covered, launch={"reference": cases.schedules}, **_ON_RANKS)
MEMORY = CHECKS.check("run_pipeline_memory_and_bubble", cases.memory_cases, answers.memory, verdicts.memory,
                      params=(), covered=cases.memory_covered,
                      launch={"reference": cases.schedules, "outputs_at_wait": False}, **_ON_RANKS)
DEVICE = CHECKS.devices(EXECUTOR)


@CHECKS.entry(SCHEDULES["gpipe"])
def check_gpipe_schedule(fn, *, hidden: bool = False) -> None:
    """``fn(p, m)`` must return a valid GPipe schedule: validator clean (deadlock included), every
    forward before any backward, simulated bubble = theory and simulated peak activations per rank
    = theory (m)."""


@CHECKS.entry(SCHEDULES["1f1b"])
def check_one_f_one_b_schedule(fn, *, hidden: bool = False) -> None:
    """``fn(p, m)`` must return a valid 1F1B schedule: validator clean (deadlock included), warm-up,
    steady one-forward-one-backward and cool-down in the canonical order, simulated bubble = theory
    and simulated peak activations per rank = theory (min(p - rank, m))."""


@CHECKS.entry(EXECUTOR)
def check_run_pipeline(fn, *, hidden: bool = False) -> None:
    """``fn(schedule, chunks, x, y)`` runs one step's forwards and backwards of the library's
    GPipe and 1F1B schedules (the first case of each launch twice with the same schedule object);
    gradients on every rank and the loss (returned by the rank holding the last stage, None
    elsewhere) must equal single-process autograd's at every step, and the schedule, the batch
    and the weights stay as the caller gave them; p = 1 (one stage, run on rank 0 of the 2-rank launch). Hidden:
    p = 3, m not a multiple of p, fp64, and p = 1 on rank 0 of the 3-rank launch."""


@CHECKS.entry(MEMORY)
def check_run_pipeline_memory(fn) -> None:
    """On 4 ranks with m = 8: the activations autograd holds peak at m micro-batches per
    rank for GPipe and at min(p - rank, m) for 1F1B, each the size of one micro-batch's; each
    time a backward begins, at most ``verdicts.KEPT_SLACK`` finished micro-batches still have their stage
    input (a receive buffer) or output alive; and the run's traced order, replayed at fixed costs, has the
    schedule's simulated bubble (p-1)/(m+p-1) exactly, whatever the load on the machine."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``run_pipeline`` live: the gradient check's first visible case, run with torch's
    default device ``meta`` in every rank (kit/device_check.py). A tensor made without ``device=`` (a
    receive buffer) fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""


def measure_executor(fn, p: int, cases, **options) -> list[dict]:
    """The demo cells' measurement of the executor ``fn`` (:func:`.demo.measure_executor`), under the lab's
    refusal."""
    return demo.measure_executor(fn, p, cases, refused=REFUSED, **options)
