"""Lab 1's checks (collectives from send/recv): each graded function against torch, its traced
messages against the algorithm, and recursive halving's refusal of other world sizes.

A test cell is a one-liner::

    checks.check_function("ring_all_reduce", ring_all_reduce)       # every rank's result vs torch
    checks.check_pattern("ring_all_reduce", ring_all_reduce)        # the traced messages
    checks.check_device("ring_all_reduce", ring_all_reduce)         # no tensor made off the inputs' device

Each launch runs one world size on every case (length × dtype × root) inside ``trace()`` and
``guard()``: only send/recv/isend/irecv are allowed, and minidist's own collectives are refused.
The cases are in ``cases.py``, the code that runs the student's function in ``answers.py``, the
comparisons in ``verdicts.py`` (docs/AUTHORING.md).
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import Registry
from minidist.checks.kit.collectives import FORBIDDEN_HINT
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.launch import COLLECTIVE_CHECK_TIMEOUT
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.lab1_collectives import answers, cases, verdicts

#: minidist's own collectives (wrappers, ``__wrapped__``, inner helpers) are refused in graded code.
REFUSED = Refusal("collectives from send/recv", ("minidist.collectives",), checks=__name__)
CHECKS = Registry(__name__)
_ON_RANKS = dict(where="launch", world=lambda case: case[0], refusal=REFUSED, launch={"forbidden_hint": FORBIDDEN_HINT})

FUNCTIONS = {name: CHECKS.check(name, partial(cases.function_cases, name), answers.COLLECTIVE[name],
                                verdicts.FUNCTION[name], covered=partial(cases.function_covered, name), **_ON_RANKS)
             for name in cases.GRADED}
PATTERNS = {name: CHECKS.check(f"{name} pattern", partial(cases.pattern_cases, name), answers.COLLECTIVE[name],
                               verdicts.PATTERN[name], params=(), title=name, covered=partial(cases.pattern_covered, name),
                               **_ON_RANKS)
            for name in cases.WITH_PATTERN}
DEVICE = {name: on_meta(FUNCTIONS[name]) for name in cases.GRADED}
REJECTS = {name: CHECKS.check(f"{name} rejects", cases.rejects_cases, answers.rejects,
                              partial(verdicts.rejected, name), params=("world_sizes",), title=name,
                              covered=cases.rejects_covered, where="launch", world=lambda n: n, refusal=REFUSED)
           for name in cases.REJECTS_WORLD_SIZE}


@CHECKS.entry(FUNCTIONS, by="name")
def check_function(name: str, fn, hidden: bool = False, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """Correctness of lab 1's graded function ``name``: every rank's result equals torch's on the same
    inputs, and the input comes back unchanged. Visible: a few shapes; hidden: world sizes 1-5 (1, 2, 4
    for halving: the lab's contract says N >= 1), lengths divisible by N, not, and below N, float32
    and float64."""


@CHECKS.entry(PATTERNS, by="name")
def check_pattern(name: str, fn, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """The traced communication pattern of lab 1's graded function ``name`` (after its correctness)."""


@CHECKS.entry(DEVICE, by="name")
def check_device(name: str, fn, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """Where the tensors of lab 1's graded function ``name`` live: its first visible case, run with
    torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made without
    ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""


@CHECKS.entry(REJECTS, by="name")
def check_rejects_world_size(name: str, fn, world_sizes=(3, 6), timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """The lab's promise for ``name`` (recursive halving): on a world size that is not a power of two it
    raises ``ValueError`` on every rank, before it communicates (a rank that goes ahead and waits for a
    partner that raised would hang)."""
