"""The toy lab's checks: the smallest lab, the grader's own test fixture (tests/fixtures/course) and
the worked example of docs/AUTHORING.md. ``add`` is checked in this process, ``allsum`` on 2 ranks;
minidist's own collectives are refused.

    checks.check_add(add)
    checks.check_allsum(allsum, hidden=True)
"""
from __future__ import annotations

from minidist.checks.kit.check import Registry
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.toylab import answers, cases, verdicts

REFUSED = Refusal("an all-reduce", ("minidist.collectives",), checks=__name__)
CHECKS = Registry(__name__)
ADD = CHECKS.check("add", cases.add_cases, answers.add, verdicts.add, refusal=REFUSED, covered=cases.add_covered)
ALLSUM = CHECKS.check("allsum", cases.allsum_cases, answers.allsum, verdicts.allsum, where="launch",
                      world=lambda case: case[0], refusal=REFUSED, covered=cases.allsum_covered)


@CHECKS.entry(ADD)
def check_add(add, hidden: bool = False) -> None:
    """``add(a, b)`` returns a + b."""


@CHECKS.entry(ALLSUM)
def check_allsum(allsum, hidden: bool = False, timeout: float = 4.0) -> None:
    """``allsum(x)``, inside a rank, returns the sum of x over the ranks and leaves x as it was."""
