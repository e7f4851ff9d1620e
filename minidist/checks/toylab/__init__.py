"""The toy lab's checks: the smallest lab, the grader's own test fixture (tests/fixtures/course) and
the worked example of docs/AUTHORING.md. Each exercise is one module: its cases and its verdict
(``add.py``, checked in this process; ``allsum.py``, an all-reduce on 2 ranks checked by the kit's
collectives), its hidden cases in ``hidden.py``; minidist's own collectives are refused.

    checks.check_add(add)
    checks.check_allsum(allsum, hidden=True)
"""
from __future__ import annotations

from minidist.checks.kit import collectives
from minidist.checks.kit.check import Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.toylab import allsum

REFUSED = Refusal("an all-reduce", ("minidist.collectives",), checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)
ADD = CHECKS.exercise("add")
ALLSUM = collectives.check(CHECKS, "allsum", allsum.cases, covered=allsum.covered, timeout=4.0)


@CHECKS.entry(ADD)
def check_add(fn, *, hidden: bool = False) -> None:
    """``add(a, b)`` returns a + b."""


@CHECKS.entry(ALLSUM)
def check_allsum(fn, *, hidden: bool = False) -> None:
    """``allsum(x)``, inside a rank, returns the sum of x over the ranks and leaves x as it was."""
