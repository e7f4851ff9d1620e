"""Library answers refused while graded code runs (:class:`refusing`, :func:`graded_call`; what a
lab refuses, and how its code is recognised, is :mod:`minidist.checks.kit.refused_code`);
:mod:`minidist.checks.kit.launch` launches checks under it and re-exports it.
"""
from __future__ import annotations

import os
import sys
import threading

import torch

from minidist.checks.kit.bindings import Snapshot
from minidist.checks.kit.refused_code import Refusal, fingerprint, resolve
from minidist.checks.kit.returned import own_tensor_subclass
from minidist.checks.kit.student_code import is_student_code
from minidist.protocol import GUARD_BINDINGS_ENV, NOTEBOOK_CELL
from minidist.trace import ForbiddenOperation

# A lab grades the student's own implementation of a technique that minidist also implements.
# While graded code runs (the body of a check on every rank, or a pure check's call of the
# student's function), any entry into minidist's implementation of that technique is refused:
# a call from the student's code, from anything it calls (a wrapper, ``__wrapped__``, an inner
# helper, another minidist module), or the graded object itself being (a subclass of) the
# library's. The check fails and says so. Only the helpers a lab hands out (``allow``) stay
# callable, with whatever they call; checks build their references outside the refused region.
# The library is recognised by its code (:mod:`minidist.checks.kit.refused_code`).
#
# The refusal holds on every thread the graded code starts (``threading``'s trace hook), on every
# thread started since this module was imported (the lab's setup cell, before any student code),
# including one already running when the graded code starts (a pool's worker waiting for work:
# ``_thread``'s function is wrapped for good, see :class:`_Threads`), and on autograd's (backward
# runs on the calling thread while graded code runs). Threads started before the import (the
# kernel's own) are out of its reach (Python 3.11 cannot trace a running thread from another).


class LibraryAnswer(ForbiddenOperation):
    """Graded code called minidist's own implementation of the technique being graded."""


class ChecksTampered(LibraryAnswer):
    """Graded code changed what a check computes its verdict with: rebound it
    (:mod:`minidist.checks.kit.bindings`), or returned a tensor subclass of its own, whose code would
    run in the comparison (:mod:`minidist.checks.kit.returned`)."""


#: Whether graded calls are watched for rebinding the checks (:mod:`minidist.checks.kit.bindings`) and for
#: returning tensor subclasses of their own: where a verdict is trusted, the grader's confirmation,
#: whose runner sets MINIDIST_GUARD_BINDINGS=1. Read once, when the lab's setup cell imports the checks
#: (before any student code; the confirmation puts its value back before every test). A notebook's
#: own run is never trusted alone, and there the watch would only cost time (each graded call's
#: return checks ~4000 bindings: lab 3's hooks make 350 of them per rank and check).
GUARD_BINDINGS = os.environ.get(GUARD_BINDINGS_ENV) == "1"
_bindings: list = []        # the process's Snapshot, taken once and brought up to date at each use


def present_bindings() -> Snapshot | None:
    """A snapshot of the bindings as they are now, where they are watched (``GUARD_BINDINGS``; None
    elsewhere). Taken once per process (5 ms, three times that on a busy machine) and then brought up
    to date (0.3 ms): :func:`minidist.checks.kit.launch.launch_named` takes it before the ranks fork, so
    that every rank starts from it."""
    if not GUARD_BINDINGS:
        return None
    if not _bindings:
        _bindings.append(Snapshot(code_only=True))
    else:
        _bindings[0].accept()
    return _bindings[0]


class refusing:
    """``with refusing(refusal): ...`` — refuse library answers while the block runs (this thread
    and threads it starts). A refused call raises :class:`LibraryAnswer` at once; catching it does
    not help: leaving the block raises it again, and so does turning the tracer off.

    The block is also where the check compares, in the same process as the graded code (on each
    rank): what a graded call rebinds between its entry and its return (the outermost student
    frame's; autograd's calls of a student's backward included) among the bindings of minidist,
    torch's comparisons and the checks themselves (:mod:`minidist.checks.kit.bindings`) is put back
    as it returns, before the check computes anything with it, and leaving the block raises
    :class:`ChecksTampered` naming it (so does a graded call that returned a tensor subclass of
    its own). What the check binds itself between graded calls (a patch
    around one) is taken as it is at each entry."""

    def __init__(self, refusal: Refusal | None, name: str = "graded function"):
        self.refusal, self.name = refusal, name
        self.violation: str | None = None

    def __enter__(self):
        if self.refusal is None:
            return self
        self.files, self.allowed, self.prints, self.allowed_prints = resolve(self.refusal)
        self.known: dict[int, tuple] = {}       # id(code) -> (code, refused?, graded?)
        self.top = sys._getframe(1)
        self.previous = sys.gettrace()
        # a thread of _Threads already traces every call for the active refusals: do not chain to that
        self.chain = None if self.previous is _threads.ambient else self.previous
        self.previous_threads = threading.gettrace() if hasattr(threading, "gettrace") else None
        self.tracer = self._trace          # one bound method, so that `is` recognises it
        self.bindings = present_bindings()
        self.rebound, self.subclasses = [], []
        sys.settrace(self.tracer)
        threading.settrace(self.tracer)
        self.autograd_threads = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)      # backward on this (traced) thread
        _threads.enter(self)
        return self

    def _known(self, frame) -> tuple:
        """(code, refused?, graded?) of the frame's code, learnt once per code object (this runs on
        every call while graded code runs)."""
        code = frame.f_code
        known = self.known.get(id(code))
        if known is None or known[0] is not code:
            refused = code.co_filename in self.files or (
                is_student_code(code.co_filename) and not NOTEBOOK_CELL.search(code.co_filename)
                and fingerprint(code) in self.prints)
            # Student code, not code a library generated for itself (a dataclass's __init__ is
            # compiled from "<string>" too, but runs in its library module's namespace).
            module = sys.modules.get(frame.f_globals.get("__name__") or "")
            file = getattr(module, "__file__", None)
            graded = is_student_code(code.co_filename) and (file is None or is_student_code(file))
            known = self.known[id(code)] = (code, refused, graded)
        return known

    def _trace(self, frame, event, arg):
        code = frame.f_code             # read once: an audited event in the grader's confirmation
        known = self.known.get(id(code))
        if known is None or known[0] is not code:
            known = self._known(frame)
        if known[1]:
            self._check(frame)
        local = self.chain(frame, event, arg) if self.chain is not None else None
        if known[2] and event == "call" and self.bindings is not None and (
                frame.f_back is None or not self._known(frame.f_back)[2]):
            self.bindings.accept()           # what the check itself bound since (a patch around the call)
            frame.f_trace_lines = False      # a graded call's entry: watch for its return only
            return self._on_return(local)
        return local

    def _on_return(self, local):
        def watch(frame, event, arg):
            nonlocal local
            if event == "return":
                self.rebound += self.bindings.diff_and_restore()
                subclass = own_tensor_subclass(arg) if arg is not None else None
                if subclass is not None:
                    self.subclasses.append(subclass)
            if local is not None:
                local = local(frame, event, arg)
            return watch
        return watch

    def _check(self, frame):
        entry = frame            # the outermost of the refused frames this call runs in
        while entry.f_back is not None and self._known(entry.f_back)[1]:
            entry = entry.f_back
        if entry.f_code in self.allowed or fingerprint(entry.f_code) in self.allowed_prints:
            return
        module = entry.f_globals.get("__name__", "?")
        target = f"{module}.{getattr(entry.f_code, 'co_qualname', entry.f_code.co_name)}"
        f = entry.f_back         # the student's line that led here, if any (below the check)
        while f is not None and f is not self.top and not is_student_code(f.f_code.co_filename):
            f = f.f_back
        if f is self.top:
            f = None
        if f is None:
            where = "the graded code is minidist's own"
        elif NOTEBOOK_CELL.search(f.f_code.co_filename):
            where = f"from notebook cell, line {f.f_lineno}"
        else:
            where = f"from {os.path.basename(f.f_code.co_filename)}, line {f.f_lineno}"
        self.violation = (f"{self.name} called minidist's own implementation: {target} ({where}). "
                          f"The rule: {self.refusal.rule()}.")
        raise LibraryAnswer(self.violation)

    def __exit__(self, etype, err, tb):
        if self.refusal is None:
            return False
        tampered = sys.gettrace() is not self.tracer and self.violation is None
        sys.settrace(self.previous)
        threading.settrace(self.previous_threads)
        torch._C._set_multithreading_enabled(self.autograd_threads)
        _threads.exit(self)
        if self.violation is not None and not isinstance(err, LibraryAnswer):
            raise LibraryAnswer(self.violation)
        if self.rebound and not isinstance(err, LibraryAnswer):
            names = ", ".join(dict.fromkeys(self.rebound))
            raise ChecksTampered(f"{self.name} rebound {names[:300]} while it ran (put back): graded code must leave "
                                 f"minidist, the checks and torch's functions as it found them")
        if self.subclasses and not isinstance(err, LibraryAnswer):
            raise ChecksTampered(f"{self.name} returned a {self.subclasses[0]}, a torch.Tensor subclass of its own: "
                                 f"its code would run in the check's comparison; return plain tensors")
        if tampered:
            raise LibraryAnswer(f"{self.name} turned off the check that refuses library answers "
                                f"(sys.settrace): graded code must leave the tracer alone.")
        return False


class _Threads:
    """Every thread started after this module's import traces its calls for the refusals active
    at the time (:meth:`ambient`; none active: one cheap call per function call): ``_thread``'s
    ``start_new_thread`` (and ``threading``'s reference to it) are wrapped for good, so a thread
    started before the graded code ran (a ``ThreadPoolExecutor``'s worker waiting for work, a
    ``_thread`` taken early) is refused library answers too once graded code runs. ``threading``
    threads started while graded code runs get the refusal's own tracer (``threading.settrace``)."""

    def __init__(self):
        self.active: list = []
        self.original = None
        self.ambient = self._ambient       # one bound method, so that `is` recognises it

    def install(self):
        import _thread
        if self.original is None:
            self.original = _thread.start_new_thread
            _thread.start_new_thread = self._start
            if getattr(threading, "_start_new_thread", None) is self.original:
                threading._start_new_thread = self._start

    def enter(self, refusing_):
        self.active.append(refusing_)

    def exit(self, refusing_):
        if refusing_ in self.active:
            self.active.remove(refusing_)

    def _ambient(self, frame, event, arg):
        active = self.active
        return active[-1]._trace(frame, event, arg) if active else None

    def _start(self, function, args, kwargs=None):
        ambient = self.ambient

        def traced(*a, **k):
            sys.settrace(ambient)
            return function(*a, **k)
        return self.original(traced, args, kwargs or {})


_threads = _Threads()
_threads.install()


def graded_call(refusal: Refusal | None, name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in this process with library answers refused (a pure check's
    call of the student's function); a library answer becomes an ``AssertionError``."""
    try:
        with refusing(refusal, name):
            return fn(*args, **kwargs)
    except LibraryAnswer as err:
        raise AssertionError(str(err)) from None
    except AssertionError as err:
        # the student's own assert: say so, and where, so that it does not read as the check's verdict
        raise StudentAssertion(f"{name} raised AssertionError itself ({_raised_at(err)}), not a check: "
                               f"{err or '(no message)'}") from err


class StudentAssertion(RuntimeError):
    """An ``assert`` in the student's own code failed while a check called it."""


def _raised_at(err: BaseException) -> str:
    """'notebook cell, line 4' (or 'file.py, line 4') of the innermost student frame of ``err``."""
    where, tb = "?", err.__traceback__
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if is_student_code(f):
            where = (f"notebook cell, line {tb.tb_lineno}" if NOTEBOOK_CELL.search(f)
                     else f"{os.path.basename(f)}, line {tb.tb_lineno}")
        tb = tb.tb_next
    return where
