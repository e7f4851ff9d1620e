"""What counts as the student's code, wherever it runs: neither minidist's, nor torch's, nor the
standard library's or an installed package's. A notebook cell (the kernel's, the confirmation's),
a string passed to ``exec``, a file handed in next to the notebook. The refusal of library answers
(:mod:`minidist.checks.kit.refusal`) and what a check makes of returned values
(:mod:`minidist.checks.kit.returned`) ask it, by the file name a code object was compiled under.
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig

import torch

import minidist


@functools.lru_cache(maxsize=None)
def _library_roots() -> tuple[str, ...]:
    roots = {os.path.dirname(os.path.abspath(minidist.__file__))}                # minidist/
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.add(os.path.realpath(paths[key]))
            roots.add(paths[key])
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        roots.add(os.path.join(prefix, "lib"))
    for m in (torch, os):
        roots.add(os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))))
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots))


_student_file: dict[str, bool] = {}


def is_student_code(filename: str) -> bool:
    """Code that is neither minidist's, nor torch's or the standard library's: a notebook cell,
    a string passed to exec, a file handed in with the notebook."""
    known = _student_file.get(filename)
    if known is None:
        known = not (filename.startswith(_library_roots()) or filename.startswith("<frozen"))
        _student_file[filename] = known
    return known
