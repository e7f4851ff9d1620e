"""What each of lab 3's end-to-end tests grades, what it refuses, and the lab's reference
standing in for the rest (:mod:`minidist.checks.lab3_zero_fsdp` and
:mod:`minidist.checks.lab3_reduce_scatter` check with these).

Points follow the work: each stage's tests grade the student's functions that stage adds
(:data:`GRADED`); the lab's other functions are the lab's reference inside the ranks
(:mod:`minidist.checks.lab3_reference`, rebound in the rank's copy of the notebook's globals),
so a wrong function loses the points of the tests that grade it, and a failure names it.
"""
from __future__ import annotations

import contextlib

from minidist.checks.kit.refused_code import Refusal
from minidist.checks.lab3_reference import REFERENCES

# The lab's wrapper class ``Zero(model, stage, optimizer="adam", lr=1e-2)`` (given in the
# notebook, built on the student's functions) has: ``__call__(x)``, ``finish_backward()``
# (after loss.backward()), ``step()``, ``zero_grad()``, ``state_tensors()`` (every
# parameter-like tensor held), ``optimizer`` and ``full_parameters()`` (flat fp32 vector).
#: minidist's ZeRO/FSDP (and the rest of minidist.data_parallel) is refused in graded code; the lab
#: hands out FlatShard.
REFUSED = Refusal("ZeRO and FSDP", ("minidist.data_parallel", "minidist.checks.lab3_reference"),
                  allow=("minidist.data_parallel.common.FlatShard",), checks="minidist.checks.lab3_zero_fsdp")
GRADED = {1: ("sharded_step",), 2: ("reduce_scatter_gradients",), 3: ("gather_parameters", "free_parameters")}


def stand_ins(stage: int) -> dict:
    """The lab's reference for every student function that stage ``stage``'s tests do not grade."""
    return {name: fn for name, fn in REFERENCES.items() if name not in GRADED[stage]}


def refusal(stage: int) -> Refusal | None:
    """REFUSED, with the stand-ins of this stage allowed (the graded functions' own references stay refused)."""
    if REFUSED is None:
        return None
    allow = tuple(f"{fn.__module__}.{name}" for name, fn in stand_ins(stage).items())
    return Refusal(REFUSED.technique, REFUSED.modules, REFUSED.allow + allow, REFUSED.checks)


def notebook_globals(Zero) -> dict:
    """The namespace ``Zero``'s methods look the lab's functions up in (the notebook's, in a rank)."""
    return getattr(getattr(Zero, "__init__", None), "__globals__", {})


class WithStandIns:
    """``Zero`` whose calls of the lab's functions not graded at ``stage`` go to the reference:
    the notebook's globals are rebound inside the rank (a copy of the notebook), never here."""

    def __init__(self, Zero, stage: int):
        self.Zero, self.stage = Zero, stage

    def __call__(self, model, stage, **kwargs):
        names = notebook_globals(self.Zero)
        for name, fn in stand_ins(self.stage).items():
            if name in names:
                names[name] = fn
        return self.Zero(model, stage, **kwargs)


def graded(stage: int) -> str:
    others = [n for n in stand_ins(stage)]
    return (f"Zero(stage={stage}), grading your {' and '.join(GRADED[stage])} "
            f"(the lab's reference stands in for {', '.join(others)})")


@contextlib.contextmanager
def bound(Zero, functions: dict):
    """The notebook's globals that ``Zero``'s methods call, bound to ``functions`` while the block runs."""
    names = notebook_globals(Zero)
    saved = {name: names[name] for name in functions if name in names}
    names.update({name: fn for name, fn in functions.items() if name in saved})
    try:
        yield
    finally:
        names.update(saved)
