"""The exercise ``goodput(interval_s, save_s, mtbf_s, restart_s=0.0, blocking_s=None)`` of lab 10:
the share of wall time that moves training forward when saving every τ seconds of work,
1 − B/τ − (τ + C)/(2M) − R/M and never below 0, where B is what a save stalls training for (the
whole C when ``blocking_s`` is None; the copy to host memory for an asynchronous save). Checked
against :func:`minidist.cost.checkpoint.goodput` (refused while the student's code runs). The answer
is the kit's ``called``; the hidden cases are the grader's, in ``hidden.py``."""
from __future__ import annotations

import math

from minidist.checks.kit.withheld import hidden_cases
from minidist.cost.checkpoint import goodput

REL, ABS = 1e-9, 1e-12


def cases(hidden: bool) -> list[dict]:
    """``args``: (τ, C, M[, R[, B]]) in seconds."""
    visible = [dict(args=(600.0, 60.0, 11160.0)),                   # a blocking save, M about 3.1 hours
               dict(args=(600.0, 60.0, 11160.0, 300.0, 2.0))]       # asynchronous: 2 s of copy, 5 min to restart
    return visible + (hidden_cases(__package__, "goodput").GOODPUT if hidden else [])


def covered(hidden: bool) -> str:
    return "; ".join(f"goodput{c['args']}" for c in cases(hidden))


def _cause(got: float, args: tuple) -> str:
    tau, c, m = args[:3]
    r = args[3] if len(args) > 3 else 0.0
    b = args[4] if len(args) > 4 and args[4] is not None else c
    mistakes = {"no floor at 0 (a goodput is a share of wall time)": 1 - b / tau - (tau + c) / (2 * m) - r / m,
                "the whole save cost C in the first term (an asynchronous save stalls training for B only)":
                    1 - c / tau - (tau + c) / (2 * m) - r / m,
                "the restart's R/M left out": 1 - b / tau - (tau + c) / (2 * m),
                "τ/(2M) for the work lost (it is (τ + C)/(2M): a failure during a save loses it too)":
                    1 - b / tau - tau / (2 * m) - r / m}
    want = goodput(*args)
    for why, value in mistakes.items():
        if math.isclose(got, value, rel_tol=REL, abs_tol=ABS) and not math.isclose(value, want, rel_tol=REL,
                                                                                     abs_tol=ABS):
            return f"; likely cause: {why}"
    return ""


def verdict(case, answer) -> str | None:
    args = case["args"]
    label = f"goodput({', '.join('None' if a is None else f'{a:g}' for a in args)})"
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"{label} returned a {type(answer).__name__}; return a number between 0 and 1"
    want = goodput(*args)
    if not math.isclose(answer, want, rel_tol=REL, abs_tol=ABS):
        return f"{label} = {answer!r}; expected {want!r}{_cause(answer, args)}"
    return None
