"""A passing check writes nothing to stderr.

nbgrader scores a test cell that writes to stderr as 0, even when every assertion in it
passed (autograder/README.md). The labs promise the opposite: a test cell that finishes
without an error has passed. So every public check of a lab runs under :func:`passes_quietly`:
Python warnings raised while it runs (by torch, by the student's code in this process,
by the check itself) and anything written to ``sys.stderr`` go to stdout instead, where
the student still reads them and nbgrader does not count them. What a rank prints already
reaches the notebook through stdout (the launcher relays it there). A failing check still
fails loudly: its exception propagates, and the traceback (stderr) scores 0 as it should.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings


def _to_stdout(message, category, filename, lineno, file=None, line=None):
    print(warnings.formatwarning(message, category, filename, lineno, line).rstrip(), file=sys.stdout)


def passes_quietly(check):
    """Decorator for a lab check: warnings and stderr writes go to stdout while it runs."""
    @functools.wraps(check)
    def quiet(*args, **kwargs):
        __tracebackhide__ = True        # noqa: F841  (IPython hides this frame from a failing cell's traceback)
        with warnings.catch_warnings():
            warnings.showwarning = _to_stdout          # restored by catch_warnings on exit
            with contextlib.redirect_stderr(sys.stdout):
                return check(*args, **kwargs)
    return quiet
