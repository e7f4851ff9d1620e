"""Lab 1's cases (collectives from send/recv): the graded functions, their visible cases (the hidden
ones are the grader's, in ``hidden.py``), and what a passing test's ✓ line says it covered.

One case of a function's test is one launch (:class:`minidist.checks.kit.collectives.Launch`: a world
size and the cases it runs, length × dtype × root); one case of the rejection of other world sizes
is (function, world size).
"""
from __future__ import annotations

import torch

from minidist.checks.kit.collectives import collective_cases
from minidist.checks.kit.launch import check_timeout
from minidist.checks.kit.withheld import hidden_cases

TIMEOUT = check_timeout(15.0)       # one launch of a collective over all its cases

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


def function_cases(name: str, hidden: bool) -> list:
    """One launch per world size of the correctness test. Visible: a few shapes in fp32; hidden: world
    sizes 1-5 (1, 2, 4 for halving), lengths divisible by N, not, and below N, fp32 and fp64."""
    kind, _, pow2 = GRADED[name]
    if hidden:
        h = hidden_cases(__package__, name)
        return collective_cases(kind, h.WORLD_SIZES_POW2 if pow2 else h.WORLD_SIZES, h.LENGTHS, h.DTYPES, name=name)
    return collective_cases(kind, (2, 4) if pow2 else (2, 3, 4), (8, 10), (torch.float32,), name=name)


def pattern_cases(name: str) -> list:
    """One launch per world size of the pattern test: lengths 8N + 3 (uneven chunks)."""
    kind, pattern, pow2 = GRADED[name]
    return collective_cases(kind, (2, 4) if pow2 else (2, 3, 4), (lambda n: 8 * n + 3,), (torch.float32,), name=name,
                            pattern=pattern)


def rejects_cases(name: str, hidden: bool) -> list[tuple[str, int]]:
    """(function, world size): one launch per world size the function must refuse (visible: 3)."""
    return [(name, n) for n in (hidden_cases(__package__, name).REJECTED if hidden else (3,))]


def _sizes(sizes) -> str:
    return ", ".join(map(str, sizes))


def function_covered(name: str, hidden: bool) -> str:
    launches = function_cases(name, hidden)
    dtypes = sorted({str(c.dtype).replace("torch.", "") for launch in launches for c in launch.cases})
    lengths = hidden_cases(__package__, name).LENGTHS_SHOWN if hidden else "8, 10"
    return (f"N={_sizes(launch.world_size for launch in launches)}, lengths {lengths}, "
            f"{'/'.join(dtypes)}: every rank's result vs torch, input unchanged")


_PATTERN_WORDS = {"naive": "through rank 0, 2(N-1)·S bytes in all",
                  "ring_reduce_scatter": "ring neighbours only, (N-1)/N·S bytes each way",
                  "ring": "ring neighbours only, 2(N-1)/N·S bytes each way",
                  "halving": "partners rank XOR 1, 2, 4, ... and back, sizes S/2, S/4, ..."}


def pattern_covered(name: str) -> str:
    launches = pattern_cases(name)
    return f"N={_sizes(launch.world_size for launch in launches)}: traced messages ({_PATTERN_WORDS[GRADED[name][1]]})"


def rejects_covered(name: str, hidden: bool) -> str:
    return f"N={_sizes(n for _, n in rejects_cases(name, hidden))} refused: ValueError on every rank before any message"
