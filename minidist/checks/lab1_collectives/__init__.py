"""Lab 1's checks (collectives from send/recv): each graded function against torch, its traced
messages against the algorithm, and recursive halving's refusal of other world sizes.

A test cell is a one-liner::

    checks.check_ring_all_reduce(ring_all_reduce)              # every rank's result vs torch
    checks.check_ring_all_reduce_pattern(ring_all_reduce)      # the traced messages
    checks.check_device(ring_all_reduce)                       # no tensor made off the inputs' device

Each launch runs one world size on every case (length × dtype × root) inside ``trace()`` and
``guard()``: only send/recv/isend/irecv are allowed, and minidist's own collectives are refused.
The cases are in ``cases.py``; the kit's collectives (:mod:`minidist.checks.kit.collectives`) run the
student's function and judge it; ``answers.py`` and ``verdicts.py`` hold the refusal of other world
sizes (docs/AUTHORING.md).
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit import collectives
from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab1_collectives import answers, cases, verdicts

#: minidist's own collectives (wrappers, ``__wrapped__``, inner helpers) are refused in graded code.
REFUSED = Refusal("collectives from send/recv", ("minidist.collectives",), checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)

FUNCTIONS = {name: collectives.check(CHECKS, f"{name}_correct", partial(cases.function_cases, name), function=name,
                                     covered=partial(cases.function_covered, name), timeout=cases.TIMEOUT)
             for name in cases.GRADED}
PATTERNS = {name: collectives.check(CHECKS, f"{name}_pattern", partial(cases.pattern_cases, name), function=name,
                                    params=(), covered=partial(cases.pattern_covered, name), timeout=cases.TIMEOUT)
            for name in cases.WITH_PATTERN}
REJECTS = {name: CHECKS.check(f"{name}_correct rejects", partial(cases.rejects_cases, name), answers.rejects,
                              verdicts.rejected, function=name, covered=partial(cases.rejects_covered, name),
                              where="launch", world=lambda case: case[1], timeout=cases.TIMEOUT)
           for name in cases.REJECTS_WORLD_SIZE}
DEVICE = CHECKS.devices(*FUNCTIONS.values())


@CHECKS.entry(FUNCTIONS["broadcast"])
def check_broadcast(fn, *, hidden: bool = False) -> None:
    """``broadcast(x, root)``: every rank ends with the root's tensor."""


@CHECKS.entry(FUNCTIONS["naive_all_reduce"])
def check_naive_all_reduce(fn, *, hidden: bool = False) -> None:
    """``naive_all_reduce(x)``: every rank ends with the sum, through rank 0."""


@CHECKS.entry(FUNCTIONS["ring_reduce_scatter"])
def check_ring_reduce_scatter(fn, *, hidden: bool = False) -> None:
    """``ring_reduce_scatter(x)``: rank r ends with chunk r of the sum (``tensor_split(N)``)."""


@CHECKS.entry(FUNCTIONS["ring_all_reduce"])
def check_ring_all_reduce(fn, *, hidden: bool = False) -> None:
    """``ring_all_reduce(x)``: every rank ends with exactly the same sum."""


@CHECKS.entry((FUNCTIONS["recursive_halving_all_reduce"], REJECTS["recursive_halving_all_reduce"]))
def check_recursive_halving_all_reduce(fn, *, hidden: bool = False) -> None:
    """``recursive_halving_all_reduce(x)``: every rank ends with the sum; on a world size that is not a
    power of two it raises ``ValueError`` on every rank, before it communicates (a rank that goes ahead
    and waits for a partner that raised would hang)."""


@CHECKS.entry(PATTERNS["naive_all_reduce"])
def check_naive_all_reduce_pattern(fn) -> None:
    """The traced messages of ``naive_all_reduce``: through rank 0, 2(N-1)·S bytes in all."""


@CHECKS.entry(PATTERNS["ring_reduce_scatter"])
def check_ring_reduce_scatter_pattern(fn) -> None:
    """The traced messages of ``ring_reduce_scatter``: ring neighbours only, (N-1)/N·S bytes each way."""


@CHECKS.entry(PATTERNS["ring_all_reduce"])
def check_ring_all_reduce_pattern(fn) -> None:
    """The traced messages of ``ring_all_reduce``: ring neighbours only, 2(N-1)/N·S bytes each way."""


@CHECKS.entry(PATTERNS["recursive_halving_all_reduce"])
def check_recursive_halving_all_reduce_pattern(fn) -> None:
    """The traced messages of ``recursive_halving_all_reduce``: partners rank XOR 1, 2, 4, ... and back."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of a graded function live (found by its name): its first visible case, run with
    torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made without
    ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
