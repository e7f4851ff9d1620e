"""Where a lab's hidden cases come from: ``<lab>/hidden.py``, which only the grader has.

A lab's ``cases.py`` holds its visible cases and asks :func:`hidden_cases` for the hidden ones. The
grader (this repository) has every lab's ``hidden.py``; the student wheel
(``python -m autograder student-dist``) leaves them out, so a test cell run with ``hidden=True`` on
a student's machine stops here, before any rank is launched, with one line saying why.

In the grader, the student's kernel has no hidden cases either: the copy of minidist it imports
leaves them out, and the grader sets ``MINIDIST_HIDDEN_CASES=confirmation`` there
(:data:`minidist.protocol.HIDDEN_CASES_ENV`). A ``hidden=True`` call then says, in one line, that its
cases run in the grader's confirmation, and passes: the hidden part of a test cell is scored by the
confirmation alone, whose processes receive the tables from the grader (never from a file the
submission can read). So the kernel, whose output the student sees, can print no hidden case.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

from minidist.protocol import HIDDEN_CASES_ENV, HIDDEN_IN_CONFIRMATION


class HiddenTestsInGrader(RuntimeError):
    """Raised for ``hidden=True`` where the lab's hidden cases are not installed (the student package)."""


def hidden_cases(package: str, check: str) -> ModuleType:
    """The module ``<package>.hidden`` (the lab's hidden case tables), for the check named ``check``.

    ``package``: the lab's checks package (a ``cases.py`` passes its ``__package__``). Raises
    :class:`HiddenTestsInGrader` when that module is not installed; an error inside it propagates."""
    name = f"{package}.hidden"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:        # the module is there but something it imports is not: a real error
            raise
    raise HiddenTestsInGrader(f"{check}: hidden tests run in the grader, not in the student package; "
                              f"run it without hidden=True here") from None


def in_confirmation(package: str) -> bool:
    """Whether this process leaves ``package``'s hidden cases to the grader's confirmation: a grading
    kernel (the grader's variable set) that has no hidden tables."""
    if os.environ.get(HIDDEN_CASES_ENV) != HIDDEN_IN_CONFIRMATION:
        return False
    try:
        return importlib.util.find_spec(f"{package}.hidden") is None
    except (ImportError, ValueError):
        return True


def left_to_confirmation(name: str) -> None:
    """The one line a ``hidden=True`` call prints in a grading kernel (stdout: nbgrader scores stderr 0)."""
    print(f"\u2026 {name} (hidden): runs in the grader's confirmation, scored there", flush=True)
