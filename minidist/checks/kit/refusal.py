"""Library answers refused while graded code runs: what a lab refuses (:class:`Refusal`, minidist's own
implementation of the technique it grades), how that code is recognised (:func:`resolve`), and the
guard (:class:`refusing`, :func:`graded_call`), around every answer (:mod:`minidist.checks.kit.run`).

Any entry into the refused code while graded code runs fails the check: a call from the student's
code, from anything it calls (a wrapper, ``__wrapped__``, an inner helper, another minidist module),
or the graded object itself being (a subclass of) the library's. Only the helpers a lab hands out
(``allow``) stay callable, with whatever they call; checks build their references outside the guard.
The code is recognised by what it is (:func:`fingerprint`), not by where it says it comes from: the
library's source exec'd under another file name is refused too, unless it comes from a notebook cell
(a solution may be written as the library writes it) or an installed file. The guard holds on every
thread the graded code starts, on threads started since the checks were imported
(:mod:`minidist.checks.kit.threads`), and on autograd's.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import sys
import threading
import types

import torch

from minidist.checks.kit.bindings import Snapshot
from minidist.checks.kit.returned import own_tensor_subclass
from minidist.checks.kit.student_code import is_student_code
from minidist.checks.kit.threads import THREADS
from minidist.protocol import GUARD_BINDINGS_ENV, NOTEBOOK_CELL
from minidist.trace import ForbiddenOperation

#: What students may import from minidist in a lab (each lab adds its own checks module).
STUDENT_IMPORTS = ("minidist.launch", "minidist.trace", "minidist.models", "minidist.plots")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """minidist's implementation of the technique a lab grades, refused while graded code runs.

    ``modules``: packages or modules whose code is refused (every file under a package);
    ``allow``: qualified names of classes or functions inside them that the lab hands out
    (their code, and whatever they call, stays allowed); ``checks``: the lab's checks module,
    named in the message.
    """
    technique: str
    modules: tuple[str, ...]
    allow: tuple[str, ...] = ()
    checks: str = ""

    def allowing(self, *names: str) -> "Refusal":
        """This refusal with ``names`` (qualified names of classes or functions) allowed besides."""
        return dataclasses.replace(self, allow=self.allow + tuple(n for n in names if n not in self.allow))

    def rule(self) -> str:
        allowed = ", ".join(STUDENT_IMPORTS + ((self.checks,) if self.checks else ()))
        extra = f" (and the helpers this lab hands out: {', '.join(self.allow)})" if self.allow else ""
        return (f"graded functions must implement {self.technique} themselves: from minidist they may use "
                f"{allowed}{extra}; minidist's own implementation ({', '.join(self.modules)}) is refused "
                f"while a graded function runs")


MIN_FINGERPRINT_BYTES = 64


def fingerprint(code: types.CodeType) -> tuple:
    """What a function's code is, wherever it was compiled: the same source gives the same
    fingerprint under any file name and at any line."""
    return (code.co_name, code.co_code, code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount)


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


@functools.lru_cache(maxsize=None)
def _fingerprints(files: frozenset) -> frozenset:
    """The fingerprints of every function, class body and comprehension in ``files``."""
    out = set()
    for path in files:
        if f"{os.sep}minidist{os.sep}checks{os.sep}" in path:
            continue          # a lab's reference is its solution: by content, it is no library answer
        try:
            with open(path, encoding="utf-8") as f:
                top = compile(f.read(), path, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError):
            continue
        # tiny functions (a property, a one-line helper) could match a student's own by chance
        out |= {fingerprint(c) for c in _codes(top) if c is not top and len(c.co_code) >= MIN_FINGERPRINT_BYTES}
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def resolve(refusal: Refusal) -> tuple[frozenset, frozenset, frozenset, frozenset]:
    """(files whose code is refused, code objects that stay allowed, the refused code's
    fingerprints, the allowed code's fingerprints)."""
    files = set()
    for name in refusal.modules:
        mod = importlib.import_module(name)
        mods = [mod]
        if hasattr(mod, "__path__"):
            for info in pkgutil.walk_packages(mod.__path__, name + "."):
                mods.append(importlib.import_module(info.name))
        files |= {m.__file__ for m in mods if getattr(m, "__file__", None)}
    allowed = set()

    def add_code(code):
        allowed.add(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                add_code(const)

    def add_function(fn):
        while fn is not None:
            if isinstance(fn, (staticmethod, classmethod)):
                fn = fn.__func__
            if isinstance(fn, property):
                for f in (fn.fget, fn.fset, fn.fdel):
                    add_function(f)
                return
            code = getattr(fn, "__code__", None)
            if code is not None:
                add_code(code)
            fn = getattr(fn, "__wrapped__", None)

    for qualified in refusal.allow:
        module, _, attr = qualified.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        if isinstance(obj, type):
            for klass in obj.__mro__:
                if klass.__module__.startswith("minidist"):
                    for value in vars(klass).values():
                        add_function(value)
        else:
            add_function(obj)
    files = frozenset(files)
    allowed_prints = frozenset(fingerprint(c) for c in allowed)
    return files, frozenset(allowed), _fingerprints(files) - allowed_prints, allowed_prints


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
        self.chain = None if self.previous is THREADS.ambient else self.previous
        self.previous_threads = threading.gettrace() if hasattr(threading, "gettrace") else None
        self.tracer = self._trace          # one bound method, so that `is` recognises it
        self.bindings = present_bindings()
        self.rebound, self.subclasses = [], []
        sys.settrace(self.tracer)
        threading.settrace(self.tracer)
        self.autograd_threads = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)      # backward on this (traced) thread
        THREADS.enter(self)
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
        THREADS.exit(self)
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
