"""Lab 4's executor cases: the library's schedules run by a student's executor, step by step, and
what a step must leave as it found it.

A case is a GPipe or 1F1B schedule of ``m`` micro-batches (Huang et al. 2019; Narayanan et al.
2021) on ``p`` stages of a residual-MLP stack; the gradients of the m micro-batch losses, each
scaled by 1/m, must add up to those of the full batch's mean loss in one process. The first case
of every launch runs twice with the same schedule object, as a training loop runs it; a case with
fewer stages than ranks (p = 1) runs on the first ranks while the others sit it out. Used by
:mod:`minidist.checks.lab4_pipeline`, which launches, compares and reports.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.checks.kit.launch import TOL, mark_case
from minidist.models import block_stack, regression_batch
from minidist.pipeline import make, partition, rank_chunks

WIDTH = 8


def _model(p: int) -> nn.Sequential:
    return block_stack(p + 1 if p > 1 else 2, WIDTH, seed=p)      # uneven stages when p > 1


def _schedule(kind, p, m):
    return make(kind, p, m)


class Case(NamedTuple):
    """One executor case: a library schedule of ``m`` micro-batches over a batch, in ``dtype``; ``p``
    stages (0: as many as the launch has ranks; fewer: run on ranks 0..p-1 while the others wait)."""
    kind: str
    m: int
    batch: int
    dtype: torch.dtype = torch.float32
    p: int = 0

    def __str__(self):
        return f"{self.kind}, m={self.m}, batch={self.batch}" + (
            "" if self.dtype == torch.float32 else f", {self.dtype}") + (f", p={self.p}" if self.p else "")


def _inputs(p, case: Case):
    """The stage model and the batch of one executor case, in its dtype."""
    x, y = regression_batch(case.batch, WIDTH, step=case.m)
    return _model(p).to(case.dtype), x.to(case.dtype), y.to(case.dtype)


def _changes(schedule, before, tensors, chunks, weights) -> str | None:
    """What the executor changed that the caller owns: the schedule, the batch, the weights."""
    if (schedule.p, schedule.m, schedule.v) != (before.p, before.m, before.v) or schedule.actions != before.actions:
        lengths = [len(a) for a in getattr(schedule, "actions", [])]
        return (f"the schedule it was given changed during the call (actions per rank: "
                f"{[len(a) for a in before.actions]} before, {lengths} after); a schedule is data that a "
                f"training loop runs again every step: read it, do not consume or edit it")
    for what, (now, was) in tensors.items():
        if not torch.equal(now, was):
            return f"the caller's {what} changed during the call: read the batch, never write into it"
    if any(not torch.equal(q.detach(), w) for q, w in zip((q for c in chunks for q in c.parameters()), weights)):
        return "the stage's weights changed during the call: the executor computes gradients, it takes no step"
    return None


def _rank_grads(progress, fn, cases, schedules):
    """Each case's step; the first case of a launch twice with the same schedule object (gradients
    zeroed between the steps), as a training loop runs it."""
    rank, world, out = dist.get_rank(), dist.get_world_size(), []
    for i, case in enumerate(cases):
        p = case.p or world
        if rank >= p:                       # a case on fewer stages than ranks: this rank sits it out
            out.append(None)
            continue
        mark_case(progress, str(case))
        model, x, y = _inputs(p, case)
        chunks = rank_chunks(partition(model, p), p, rank)
        schedule = schedules[case.kind, case.m, p]
        before, x0, y0 = copy.deepcopy(schedule), x.clone(), y.clone()
        weights = [q.detach().clone() for c in chunks for q in c.parameters()]
        steps = []
        for _ in range(2 if i == 0 else 1):
            for q in (q for c in chunks for q in c.parameters()):
                q.grad = None
            loss = fn(schedule, chunks, x, y)
            loss = float(loss) if isinstance(loss, torch.Tensor) else loss
            grads = [None if q.grad is None else q.grad.clone() for c in chunks for q in c.parameters()]
            changed = _changes(schedule, before, {"x": (x, x0), "y": (y, y0)}, chunks, weights)
            steps.append((loss, grads, changed))
            if changed:
                break
        out.append(steps)
    return out


EXECUTOR_CASES = {   # hidden -> p -> cases
    False: {2: [Case("gpipe", 2, 8), Case("1f1b", 2, 8)], 4: [Case("gpipe", 4, 8), Case("1f1b", 4, 8)]},
    True: {3: [Case("gpipe", 1, 6), Case("1f1b", 5, 10), Case("gpipe", 6, 12),
               Case("1f1b", 3, 9, torch.float64), Case("1f1b", 4, 8, p=1)],
           4: [Case("1f1b", 2, 8), Case("1f1b", 8, 16)]},
}


def _compare_step(where, r, p, m, loss, grads, want, ref_loss):
    if any(g is None for g in grads):
        raise AssertionError(f"{where}: rank {r} has parameters without a gradient; every "
                             f"stage's backward must reach its weights")
    errs = [(g - w).abs().max().item() for g, w in zip(grads, want)]
    if max(errs) > TOL:
        ratio = (grads[0].norm() / want[0].norm()).item() if want[0].norm() > 0 else float("nan")
        hint = ""
        if abs(ratio - m) < 1e-3 * m and m > 1:
            hint = (f" The gradients are {m}x too large: the loss of each micro-batch must be "
                    f"scaled by 1/m, so that m accumulated gradients average, not sum.")
        elif ratio < 0.99:
            hint = (" Too small: are gradients of some micro-batches lost (overwritten, or "
                    ".grad zeroed between micro-batches)?")
        raise AssertionError(f"{where}: rank {r}'s gradients differ from single-process "
                             f"training (max |error| {max(errs):.3g}, |grad| ratio {ratio:.3f}).{hint}")
    if r == p - 1:
        if loss is None or abs(loss - ref_loss) > TOL:
            hint = (" With p = 1 the one stage is both the first and the last: it reads the batch and "
                    "computes the loss." if p == 1 else "")
            raise AssertionError(f"{where}: the last stage (rank {r}) returned loss {loss}, "
                                 f"expected the full-batch loss {ref_loss:.6f} "
                                 f"(sum of the m micro-batch losses, each scaled by 1/m).{hint}")
    elif loss is not None:
        raise AssertionError(f"{where}: rank {r} returned {loss!r}; only the rank holding the "
                             f"last stage has a loss, the others return None")
