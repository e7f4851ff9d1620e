"""What lab 10's checks do to the world around a graded call: make a save fail at one point (the
disk full while writing the k-th file or ``metadata.json``, the rename failing) and observe which
files a load opens. Each replaces a few functions (safetensors' and the standard library's, and the
student's globals that bind them) for the one call and puts them back after it; the replacements
call the real functions, so nothing here reads or writes a checkpoint of its own."""
from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil

import safetensors
import safetensors.torch

CRASH = "No space left on device (injected: the disk filled up in the middle of the save)"
RENAME = "Input/output error (injected: the rename failed)"
_WRITES = "wax+"


class _Swaps:
    """Attributes and globals replaced for one call of graded code, and put back after it."""

    def __init__(self, fn):
        self._names = getattr(fn, "__globals__", None) if hasattr(fn, "__code__") else None
        self._undo = []

    def attr(self, owner, name, new):
        self._undo.append((setattr, owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def everywhere(self, owners_and_names, new, old):
        """``new`` for ``old`` in each (module, name) and wherever the student's globals bind ``old``."""
        for owner, name in owners_and_names:
            self.attr(owner, name, new)
        for name, value in list((self._names or {}).items()):
            if value is old:
                self._undo.append((dict.__setitem__, self._names, name, value))
                self._names[name] = new

    def opens(self, wrap):
        """Every ``open`` graded code can reach wrapped by ``wrap(real_open)``: the builtin, ``io.open``
        (pathlib's) and the student's global ``open`` where one is bound (IPython binds its own in a
        notebook's namespace, around the builtin)."""
        real = builtins.open
        self.attr(builtins, "open", wrap(real))
        self.attr(io, "open", wrap(real))
        mine = (self._names or {}).get("open")
        if mine is not None and mine is not real:
            self._undo.append((dict.__setitem__, self._names, "open", mine))
            self._names["open"] = wrap(mine)

    def undo(self):
        for put, owner, name, value in reversed(self._undo):
            put(owner, name, value)


def _is_named(file, name: str) -> bool:
    return isinstance(file, (str, os.PathLike)) and os.path.basename(os.fspath(file)) == name


@contextlib.contextmanager
def failing(fn, fail):
    """The save's point of failure: ``"metadata"`` (writing metadata.json fails), ``"rename"`` (every
    rename fails), ``("file", k)`` (the k-th safetensors file written fails); None: nothing fails."""
    swaps = _Swaps(fn)
    if fail == "metadata":
        def failing_open(real_open):
            def open_(file, mode="r", *args, **kwargs):
                if _is_named(file, "metadata.json") and any(c in mode for c in _WRITES):
                    raise OSError(28, CRASH)
                return real_open(file, mode, *args, **kwargs)
            return open_
        swaps.opens(failing_open)
    elif fail == "rename":
        def failing_rename(*args, **kwargs):
            raise OSError(5, RENAME)
        for name in ("rename", "replace", "renames"):
            swaps.attr(os, name, failing_rename)
        swaps.attr(shutil, "move", failing_rename)
    elif fail is not None:
        _, at = fail
        real_save, count = safetensors.torch.save_file, [0]

        def failing_write(*args, **kwargs):
            count[0] += 1
            if count[0] == at + 1:
                raise OSError(28, CRASH)
            return real_save(*args, **kwargs)
        swaps.everywhere([(safetensors.torch, "save_file")], failing_write, real_save)
    try:
        yield
    finally:
        swaps.undo()


@contextlib.contextmanager
def observed(fn, opened: list):
    """Every file graded code opens (safetensors' safe_open, load_file, open), by name, into ``opened``."""
    swaps = _Swaps(fn)
    real_safe_open, real_load_file = safetensors.safe_open, safetensors.torch.load_file

    def seen_safe_open(filename, *args, **kwargs):
        opened.append(os.path.basename(os.fspath(filename)))
        return real_safe_open(filename, *args, **kwargs)

    def seen_load_file(filename, *args, **kwargs):
        opened.append(os.path.basename(os.fspath(filename)))
        return real_load_file(filename, *args, **kwargs)

    def seen_open(real_open):
        def open_(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)):
                opened.append(os.path.basename(os.fspath(file)))
            return real_open(file, *args, **kwargs)
        return open_
    swaps.everywhere([(safetensors, "safe_open"), (safetensors.torch, "safe_open")], seen_safe_open, real_safe_open)
    swaps.everywhere([(safetensors.torch, "load_file")], seen_load_file, real_load_file)
    swaps.opens(seen_open)
    try:
        yield
    finally:
        swaps.undo()
