"""What a lab refuses while graded code runs (:class:`Refusal`: minidist's own implementation of
the technique it grades) and how that code is recognised wherever it was compiled
(:func:`fingerprint`, :func:`resolve`). :mod:`minidist.checks.kit.refusal` enforces it.

The library is recognised by its code, not by where the code says it comes from: a function of
the refused modules compiled again (the module's source exec'd under another file name, or one
function's source) has the same bytecode, names and variables, and is refused the same way.
This applies to code from neither a notebook cell (a solution may be written exactly as the
library or the lab's reference writes it) nor an installed file (minidist.models' MLP forward
is the tensor-parallel one's): code exec'd under such a name escapes.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import types


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
