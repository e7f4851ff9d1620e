"""Lab 4's cases (pipeline parallelism): the schedules' (p, m), the executor's runs, the memory run,
their inputs (a seeded residual-MLP stack and batch, the library's schedules), what the lab refuses,
and what a passing test's ✓ line says it covered.

The hidden cases are the grader's, in ``hidden.py``. A schedule case is (kind, p, m). An executor case
is one launch, (world size, its runs): a run is a
:class:`Case`, a library GPipe or 1F1B schedule (Huang et al. 2019; Narayanan et al. 2021) of ``m``
micro-batches over ``p`` stages; the gradients of the m micro-batch losses, each scaled by 1/m, must
add up to those of the full batch's mean loss in one process. The first run of every launch runs
twice with the same schedule object, as a training loop runs it; a run with fewer stages than ranks
(p = 1) runs on the first ranks while the others sit it out. The memory case is one launch of 4
ranks, GPipe and 1F1B at m = 8.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import NamedTuple

import torch
import torch.nn as nn

from minidist.checks.kit.withheld import hidden_cases
from minidist.models import block_stack, regression_batch
from minidist.pipeline import Costs, make, partition, rank_chunks

WIDTH = 8
SLEEP = Costs(F=0.02, B=0.04)        # seconds per action in sleep-compute mode (the demo's runs)

# ----------------------------------------------------------------------------- schedules
#: the graded schedule builder of each kind, as the notebook names it (the ✓ line names it so)
SCHEDULE_FUNCTION = {"gpipe": "gpipe_schedule", "1f1b": "one_f_one_b_schedule"}
SCHEDULE_CASES = [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8)]      # (p, m)


def _schedules(kind: str, hidden: bool) -> list[tuple]:
    return hidden_cases(__package__, SCHEDULE_FUNCTION[kind]).SCHEDULES if hidden else SCHEDULE_CASES


def schedule_cases(kind: str, hidden: bool) -> list[tuple]:
    """(kind, p, m) per call of the student's builder."""
    return [(kind, p, m) for p, m in _schedules(kind, hidden)]


def schedule_covered(kind: str, hidden: bool) -> str:
    shown = ", ".join(f"{p}/{m}" for p, m in _schedules(kind, hidden))
    return f"p/m = {shown}: valid, {kind}'s compute order, bubble and peak = theory"


# ----------------------------------------------------------------------------- executor
EXECUTOR_FUNCTION = "run_pipeline"        # the graded executor, as the notebook names it


class Case(NamedTuple):
    """One executor run: a library schedule of ``m`` micro-batches over a batch, in ``dtype``; ``p``
    stages (0: as many as the launch has ranks; fewer: run on ranks 0..p-1 while the others wait)."""
    kind: str
    m: int
    batch: int
    dtype: torch.dtype = torch.float32
    p: int = 0

    def __str__(self):
        return f"{self.kind}, m={self.m}, batch={self.batch}" + (
            "" if self.dtype == torch.float32 else f", {self.dtype}") + (f", p={self.p}" if self.p else "")


#: world size -> its runs; p = 1 on rank 0 of the 2-rank launch: what the text stresses, everything from the schedule
EXECUTOR_CASES = {2: [Case("gpipe", 2, 8), Case("1f1b", 2, 8), Case("1f1b", 2, 8, p=1)],
                  4: [Case("gpipe", 4, 8), Case("1f1b", 4, 8)]}


def _executor_runs(hidden: bool) -> dict:
    return hidden_cases(__package__, "run_pipeline").EXECUTOR if hidden else EXECUTOR_CASES


def executor_cases(hidden: bool) -> list[tuple]:
    """(world size, its runs) per launch."""
    return [(world, tuple(runs)) for world, runs in _executor_runs(hidden).items()]


def executor_covered(hidden: bool) -> str:
    launches = _executor_runs(hidden)
    sizes = sorted({c.p or world for world, runs in launches.items() for c in runs})
    dtypes = "fp32/fp64" if any(c.dtype != torch.float32 for runs in launches.values() for c in runs) else "fp32"
    return (f"p = {', '.join(map(str, sizes))}, GPipe and 1F1B, {dtypes}: gradients and loss vs one process, "
            f"a schedule run twice, schedule, batch and weights untouched")


def model(p: int) -> nn.Sequential:
    """The single-process model of a run on p stages."""
    return block_stack(p + 1 if p > 1 else 2, WIDTH, seed=p)      # uneven stages when p > 1


def inputs(p: int, case: Case):
    """The model and the batch of one executor run, in its dtype."""
    x, y = regression_batch(case.batch, WIDTH, step=case.m)
    return model(p).to(case.dtype), x.to(case.dtype), y.to(case.dtype)


def rank_inputs(p: int, case: Case, rank: int):
    """What rank ``rank`` is given for one executor run: its chunks of the model cut into p stages
    (one: v = 1), and the batch."""
    model_, x, y = inputs(p, case)
    return rank_chunks(partition(model_, p), p, rank), x, y


def schedules(case) -> dict:
    """{(kind, p, m): the library's schedule} for every run of a launch ``case`` = (world, runs):
    built on each rank before the student's code, outside the refusal (``make`` is refused)."""
    world, runs = case
    return {(c.kind, c.p or world, c.m): make(c.kind, c.p or world, c.m) for c in runs}


def schedule_state(s) -> dict:
    """A schedule as a step must leave it, as plain data: (p, m, v), the actions per rank and a hash of
    every action. Read defensively: the student's code may have changed it into anything."""
    try:
        lengths = [len(prog) for prog in s.actions]
        actions = [[dataclasses.astuple(a) for a in prog] for prog in s.actions]
        shape = [s.p, s.m, s.v]
    except Exception:       # noqa: BLE001  (a schedule the executor took apart: it changed, whatever it is)
        return {"shape": None, "lengths": None, "hash": None}
    return {"shape": shape, "lengths": lengths, "hash": hashlib.sha256(repr(actions).encode()).hexdigest()}


# ----------------------------------------------------------------------------- memory and bubble
MEMORY_P, MEMORY_M = 4, 8


def memory_runs(m: int) -> tuple:
    return (Case("gpipe", m, 4 * m), Case("1f1b", m, 4 * m))


def memory_cases() -> list[tuple]:
    """One launch: 4 ranks, GPipe and 1F1B at m = 8 (batch 4m)."""
    return [(MEMORY_P, memory_runs(MEMORY_M))]


def memory_covered() -> str:
    return (f"p = {MEMORY_P}, m = {MEMORY_M}, GPipe and 1F1B: activations per rank = theory, nothing kept "
            f"after its backward, replayed bubble = the schedule's")


def stage(p: int, rank: int) -> nn.Module:
    """Rank ``rank``'s stage of the memory runs' model (p blocks, one per stage)."""
    return rank_chunks(partition(block_stack(p, WIDTH), p), p, rank)[0]
