"""The toy lab's cases: ``add`` on a few numbers, ``allsum`` as an all-reduce on 2 ranks."""
from __future__ import annotations

import torch

from minidist.checks.kit.collectives import collective_cases


def add_cases(hidden: bool) -> list[tuple]:
    """(a, b, a + b): the visible case, and negative numbers and floats hidden."""
    return [(1, 2, 3)] + ([(10, -3, 7), (0.5, 0.25, 0.75)] if hidden else [])


def allsum_cases(hidden: bool) -> list[tuple]:
    """(world size, its cases) per launch: 2 ranks; length 3 in fp32, hidden 5 and 1 in fp64."""
    if hidden:
        return collective_cases("all_reduce", (2,), (5, 1), (torch.float64,))
    return collective_cases("all_reduce", (2,), (3,), (torch.float32,))


def add_covered(hidden: bool) -> str:
    return ", ".join(f"add({a}, {b}) = {c}" for a, b, c in add_cases(hidden))


def allsum_covered(hidden: bool) -> str:
    return "2 ranks, " + ("lengths 5 and 1 in fp64" if hidden else "length 3 in fp32") + ": the sum on every rank"
