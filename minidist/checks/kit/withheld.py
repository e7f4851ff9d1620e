"""Where a lab's hidden cases come from: ``<lab>/hidden.py``, which only the grader has.

A lab's ``cases.py`` holds its visible cases and asks :func:`hidden_cases` for the hidden ones. The
grader (this repository) has every lab's ``hidden.py``; the student wheel
(``python -m autograder student-dist``) leaves them out, so a test cell run with ``hidden=True`` on
a student's machine stops here, before any rank is launched, with one line saying why.
"""
from __future__ import annotations

import importlib
from types import ModuleType


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
