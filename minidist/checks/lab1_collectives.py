"""Lab 1's checks (collectives from send/recv): each graded function, its cases and pattern.

A test cell of the lab is a one-liner::

    checks.check_function("ring_all_reduce", ring_all_reduce)       # correctness
    checks.check_pattern("ring_all_reduce", ring_all_reduce)        # traced communication
"""
from __future__ import annotations

import torch

from minidist.checks.collectives import check_collective
from minidist.checks.common import COLLECTIVE_CHECK_TIMEOUT, Refusal
from minidist.checks.quiet import passes_quietly

#: minidist's own collectives (wrappers, ``__wrapped__``, inner helpers) are refused in graded code.
REFUSED = Refusal("collectives from send/recv", ("minidist.collectives",), checks=__name__)

LAB1 = {   # graded function -> (kind, pattern, power-of-two world sizes only)
    "broadcast": ("broadcast", None, False),
    "naive_all_reduce": ("all_reduce", "naive", False),
    "ring_reduce_scatter": ("reduce_scatter", "ring_reduce_scatter", False),
    "ring_all_reduce": ("all_reduce", "ring", False),
    "recursive_halving_all_reduce": ("all_reduce", "halving", True),
}


@passes_quietly
def check_function(name: str, fn, hidden: bool = False, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """Correctness of lab 1's graded function ``name``. Visible: a few shapes; hidden:
    world sizes 2-5 (powers of two for halving), lengths divisible by N, not, and below
    N, float32 and float64."""
    kind, _, pow2 = LAB1[name]
    if hidden:
        sizes = (2, 4) if pow2 else (2, 3, 4, 5)
        lengths, dtypes = (1, lambda n: n - 1, lambda n: 2 * n + 1, lambda n: 4 * n, 37), (torch.float32, torch.float64)
    else:
        sizes, lengths, dtypes = ((2, 4) if pow2 else (2, 3, 4)), (8, 10), (torch.float32,)
    check_collective(fn, kind, sizes, lengths, dtypes, name=name, timeout=timeout, refuse=REFUSED)


@passes_quietly
def check_pattern(name: str, fn, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """The traced communication pattern of lab 1's graded function ``name``."""
    kind, pattern, pow2 = LAB1[name]
    if pattern is None:
        raise ValueError(f"lab 1 has no pattern test for {name}")
    sizes = (2, 4) if pow2 else (2, 3, 4)
    check_collective(fn, kind, sizes, (lambda n: 8 * n + 3,), (torch.float32,), pattern=pattern, name=name,
                     timeout=timeout, refuse=REFUSED)
