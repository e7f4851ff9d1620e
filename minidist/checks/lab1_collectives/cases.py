"""Lab 1's cases (collectives from send/recv): the graded functions, their visible cases (the hidden
ones are the grader's, in ``hidden.py``), and what a passing test's ✓ line says it covered.

One case is one launch: (world size, the cases of :class:`minidist.checks.kit.collectives.Case` it
runs: length × dtype × root).
"""
from __future__ import annotations

import torch

from minidist.checks.kit.collectives import collective_cases
from minidist.checks.kit.withheld import hidden_cases

GRADED = {   # graded function -> (kind, pattern, power-of-two world sizes only)
    "broadcast": ("broadcast", None, False),
    "naive_all_reduce": ("all_reduce", "naive", False),
    "ring_reduce_scatter": ("reduce_scatter", "ring_reduce_scatter", False),
    "ring_all_reduce": ("all_reduce", "ring", False),
    "recursive_halving_all_reduce": ("all_reduce", "halving", True),
}
WITH_PATTERN = [name for name, (_, pattern, _) in GRADED.items() if pattern is not None]
#: the lab's promise for recursive halving: a world size that is not a power of two is refused
REJECTS_WORLD_SIZE = ["recursive_halving_all_reduce"]

def function_cases(name: str, hidden: bool) -> list[tuple]:
    """(world size, its cases) per launch of the correctness test. Visible: a few shapes in fp32;
    hidden: world sizes 1-5 (1, 2, 4 for halving), lengths divisible by N, not, and below N, fp32
    and fp64."""
    kind, _, pow2 = GRADED[name]
    if hidden:
        h = hidden_cases(__package__, name)
        return collective_cases(kind, h.WORLD_SIZES_POW2 if pow2 else h.WORLD_SIZES, h.LENGTHS, h.DTYPES)
    return collective_cases(kind, (2, 4) if pow2 else (2, 3, 4), (8, 10), (torch.float32,))


def pattern_cases(name: str) -> list[tuple]:
    """(world size, its cases) per launch of the pattern test: lengths 8N + 3 (uneven chunks)."""
    kind, _, pow2 = GRADED[name]
    return collective_cases(kind, (2, 4) if pow2 else (2, 3, 4), (lambda n: 8 * n + 3,), (torch.float32,))


def rejects_cases(world_sizes) -> list[int]:
    """One launch per world size that the function must refuse."""
    return list(world_sizes)


def _sizes(sizes) -> str:
    return ", ".join(map(str, sizes))


def function_covered(name: str, hidden: bool) -> str:
    launches = function_cases(name, hidden)
    dtypes = sorted({str(c.dtype).replace("torch.", "") for _, cases in launches for c in cases})
    lengths = hidden_cases(__package__, name).LENGTHS_SHOWN if hidden else "8, 10"
    return (f"N={_sizes(n for n, _ in launches)}, lengths {lengths}, "
            f"{'/'.join(dtypes)}: every rank's result vs torch, input unchanged")


_PATTERN_WORDS = {"naive": "through rank 0, 2(N-1)·S bytes in all",
                  "ring_reduce_scatter": "ring neighbours only, (N-1)/N·S bytes each way",
                  "ring": "ring neighbours only, 2(N-1)/N·S bytes each way",
                  "halving": "partners rank XOR 1, 2, 4, ... and back, sizes S/2, S/4, ..."}


def pattern_covered(name: str) -> str:
    return f"N={_sizes(n for n, _ in pattern_cases(name))}: traced messages ({_PATTERN_WORDS[GRADED[name][1]]})"


def rejects_covered(world_sizes) -> str:
    return f"N={_sizes(world_sizes)} refused: ValueError on every rank before any message"
