"""The library side of ``python -m autograder similarity``: everything the course ships that a student
could copy, as one text, and its fingerprints.

The text is every ``.py`` file of the installed ``minidist`` package, one after another (sorted by
path), ``minidist/checks/`` included: the shared kit and every lab's checks modules (cases, verdicts,
references, helpers, hidden tables), not only the modules a lab refuses. One text, so that an answer
that copies a function and the helpers it calls from several files is compared with all of them at
once.

The package is 1.3 MB of source: tokenising it (pygments, copydetect's ``filter_code``) takes most of
the time, so it is done once per process (:func:`library`), and :class:`LibraryPrint` stands in for
copydetect's ``CodeFingerprint`` without building its dictionary of every k-gram's positions (a sorted
array answers the few hashes an answer shares). It gives copydetect's ``compare_files`` exactly what a
``CodeFingerprint`` with a window of 1 and no boilerplate would: what the release gives in a cell is
left out of the answer's fingerprints, which is enough, since only shared hashes count.
"""
from __future__ import annotations

import ast
import bisect
import functools
import importlib
import itertools
import os
from pathlib import Path


def package_files() -> list[Path]:
    """Every ``.py`` file of the installed minidist package, sorted by its path inside it."""
    root = Path(importlib.import_module("minidist").__file__).parent
    return sorted((p for p in root.rglob("*.py") if "__pycache__" not in p.parts),
                  key=lambda p: p.relative_to(root).as_posix())


def library_source(files: list[Path] | None = None) -> tuple[str, list[tuple[int, int, str]]]:
    """The package as one text, each file headed by a comment naming it, and (start, end, "file: name")
    of each top-level function and class, to say what an answer matched."""
    files = package_files() if files is None else files
    root = Path(importlib.import_module("minidist").__file__).parent
    parts, units, at = [], [], 0
    for path in files:
        rel = "minidist/" + path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8").rstrip("\n") + "\n\n"
        head = f"# {rel}\n"
        lines = text.splitlines(keepends=True)
        starts = list(itertools.accumulate([0] + [len(line) for line in lines]))
        try:
            body = ast.parse(text).body
        except SyntaxError:         # still compared; only its functions go unnamed
            body = []
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                units.append((at + len(head) + starts[first - 1], at + len(head) + starts[node.end_lineno],
                              f"{rel}: {node.name}"))
        parts.append(head + text)
        at += len(head) + len(text)
    return "".join(parts), units


class _Positions:
    """copydetect's ``hash_idx`` of the library (hash -> every position of that k-gram), looked up in a
    sorted array instead of a dictionary of 300,000 entries."""

    def __init__(self, hashes):
        import numpy as np
        self.order = np.argsort(hashes, kind="stable")
        self.sorted = hashes[self.order]

    def __getitem__(self, h):
        lo, hi = self.sorted.searchsorted(h, "left"), self.sorted.searchsorted(h, "right")
        return self.order[lo:hi]


class LibraryPrint:
    """The fingerprints of a long text, in the attributes copydetect's ``compare_files`` reads: every
    k-gram hashed (a window of 1), no boilerplate."""

    def __init__(self, source: str, k: int, lexer_name: str):
        from copydetect.utils import filter_code, hashed_kgrams
        self.raw_code = source
        self.filtered_code, self.offsets = filter_code(source, lexer_name)
        self.k = k
        every = hashed_kgrams(self.filtered_code, k)
        self.hash_idx = _Positions(every)
        self.hashes = set(every.tolist())
        # copydetect's token coverage: the characters some fingerprinted k-gram covers, here all of them
        self.token_coverage = len(self.filtered_code) if len(self.filtered_code) >= k else 0


@functools.lru_cache(maxsize=4)
def _library(stamp: tuple, k: int, lexer_name: str):
    source, units = library_source([Path(p) for p, _, _ in stamp])
    return source, units, LibraryPrint(source, k, lexer_name)


def library(k: int, lexer_name: str) -> tuple[str, list, LibraryPrint]:
    """(text, units, fingerprints) of the installed package, made once per process and again only when
    a file of it changes."""
    stamp = tuple((str(p), os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in package_files())
    return _library(stamp, k, lexer_name)


def matched_units(slices, units: list[tuple[int, int, str]]) -> list[str]:
    """The library's functions and classes that hold the shared code ``slices`` (the library's side of a
    comparison: starts, ends), most shared first. ``units`` are sorted and do not overlap."""
    starts = [lo for lo, _, _ in units]
    shared: dict[str, int] = {}
    for start, end in zip(*slices) if len(slices) and len(slices[0]) else ():
        i = max(0, bisect.bisect_right(starts, int(start)) - 1)
        while i < len(units) and units[i][0] < int(end):
            lo, hi, label = units[i]
            n = min(int(end), hi) - max(int(start), lo)
            if n > 0:
                shared[label] = shared.get(label, 0) + n
            i += 1
    return sorted(shared, key=lambda label: -shared[label])
