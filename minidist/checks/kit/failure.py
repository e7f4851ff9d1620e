"""What a failing test cell shows: the test cell's line, then the problem, and no frame of the checks.

A check that fails raises from deep inside the kit (the registry's call, :func:`~minidist.checks.kit.run.run`,
the answer, the launch); a student reading five frames of grader code before the message learns
nothing from them. The kit's frames set ``__tracebackhide__`` (IPython skips such frames, all but the
innermost), and every exception leaving a public check carries ``_render_traceback_`` (IPython's hook
for exceptions that render themselves, :meth:`InteractiveShell.showtraceback`): the frames of the
student's code it passed through (the test cell's line first), then the exception's own line. The
message itself says the case and, for an exception of the student's code, the student's line
(:func:`minidist.checks.kit.run.student_raised`; a launch's report, by rank).
"""
from __future__ import annotations

from minidist.checks.kit.student_code import is_student_code
from minidist.runtime.rank_process import format_frame

RULE = "-" * 75


def shown_frames(err: BaseException) -> list[str]:
    """The frames of ``err``'s traceback a student reads: their own code's (the test cell, the
    solution cells), outermost first, none hidden with ``__tracebackhide__``."""
    out, tb = [], err.__traceback__
    while tb is not None:
        frame, code = tb.tb_frame, tb.tb_frame.f_code
        if is_student_code(code.co_filename) and not frame.f_locals.get("__tracebackhide__"):
            out.append(format_frame(code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return out


def rendered(err: BaseException) -> list[str]:
    """The traceback a notebook shows for ``err``: a header, the student's frames, the message."""
    head = f"{type(err).__name__:<42}Traceback (most recent call last)"
    return [RULE, head, *shown_frames(err), f"{type(err).__name__}: {err}"]


def renders_itself(err: BaseException) -> BaseException:
    """``err``, which IPython now shows as :func:`rendered` says (it keeps its type and message)."""
    try:
        err._render_traceback_ = lambda: rendered(err)
    except (AttributeError, TypeError):     # an exception type without a __dict__: IPython's own rendering
        pass
    return err
