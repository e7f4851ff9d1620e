"""The toy lab's ``add(a, b)``: its cases (the hidden ones are the grader's, in ``hidden.py``) and its
verdict, checked in this process; the answer is the kit's ``called``, what ``add(*case["args"])`` returned."""
from __future__ import annotations

from minidist.checks.kit.withheld import hidden_cases


def cases(hidden: bool) -> list[dict]:
    """The visible case, and the hidden ones after it."""
    return [dict(args=(1, 2), want=3)] + (hidden_cases(__package__, "add").ADD if hidden else [])


def covered(hidden: bool) -> str:
    return ", ".join(f"add{case['args']} = {case['want']}" for case in cases(hidden))


def verdict(case, answer) -> str | None:
    (a, b), want = case["args"], case["want"]
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or answer != want:
        return f"add({a}, {b}) returned {answer!r}; expected {want}"
    return None
