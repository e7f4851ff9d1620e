"""The toy lab's cases: ``add`` on a few numbers, ``allsum`` as an all-reduce on 2 ranks. The hidden
cases are the grader's, in ``hidden.py`` (:func:`minidist.checks.kit.withheld.hidden_cases`)."""
from __future__ import annotations

import torch

from minidist.checks.kit.collectives import collective_cases
from minidist.checks.kit.withheld import hidden_cases


def add_cases(hidden: bool) -> list[tuple]:
    """(a, b, a + b): the visible case, and the hidden ones after it."""
    return [(1, 2, 3)] + (hidden_cases(__package__, "add").ADD if hidden else [])


def allsum_cases(hidden: bool) -> list[tuple]:
    """(world size, its cases) per launch: 2 ranks; length 3 in fp32, the hidden lengths and dtypes."""
    if hidden:
        h = hidden_cases(__package__, "allsum")
        return collective_cases("all_reduce", (2,), h.ALLSUM_LENGTHS, h.ALLSUM_DTYPES)
    return collective_cases("all_reduce", (2,), (3,), (torch.float32,))


def add_covered(hidden: bool) -> str:
    return ", ".join(f"add({a}, {b}) = {c}" for a, b, c in add_cases(hidden))


def allsum_covered(hidden: bool) -> str:
    shown = hidden_cases(__package__, "allsum").ALLSUM_SHOWN if hidden else "length 3 in fp32"
    return "2 ranks, " + shown + ": the sum on every rank"
