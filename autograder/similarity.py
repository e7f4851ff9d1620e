"""``python -m autograder similarity OUT``: which graded answers look copied, for a person to read.

After ``grade`` wrote OUT, every answer cell of every graded notebook (an nbgrader solution cell, by
its grade id, as ``OUT/autograded/<student>/<lab>/<notebook>.ipynb`` holds it) is compared with the
library's answer (the minidist modules that the lab's checks refuse, ``minidist.checks.<lab>.REFUSED``:
:mod:`minidist.checks.kit.refused_code` says why they are the library's answer) and with every
classmate's answer to the same cell.

The comparison is copydetect's: each text is tokenised, names become one letter (renaming a variable
changes nothing), comments and spacing are dropped, and the k-grams of what is left are hashed and
winnowed (Schleimer, Wilkerson and Aiken, "Winnowing: local algorithms for document fingerprinting",
SIGMOD 2003, the method of MOSS; here with a window of 1, see ``WINDOW``): every run of ``K`` shared
characters is seen. What the release already gives in the cell (the signature, the docstring; as OUT's
gradebook recorded it) is boilerplate and never counts. A pair's score is the share of an answer's
fingerprinted tokens found in the other text: against the library, the student's share (the library's
modules hold far more); between classmates, the larger of the two shares (one copy may add code).

It flags for review and changes no score: it writes ``OUT/similarity.html`` (the flagged pairs side
by side, the shared code marked, highest first) and fills ``results.csv``'s ``similarity`` column (the
highest flagged score of the answers a test calls, and with whom). Nothing else in OUT changes.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import itertools
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from autograder.course import nbg
from autograder.notebooks import normalized

#: k-gram size, in characters of the filtered text (a name is one character, an operator one or two):
#: 25 is about one line of code such as ``V.V(V[V],V=V,V=V)``. Shorter k-grams match the idioms every
#: answer to a lab shares (``dist.get_rank(group)``); longer ones miss copies of short answers.
K = 25
#: winnowing window: 1 keeps every k-gram's hash. A wider window keeps the smallest hash of each window,
#: and Python salts its string hash per process (copydetect hashes with ``hash``), so which k-grams are
#: kept, and the scores, would change from one run to the next; an answer cell is short enough to keep all.
WINDOW = 1
#: the score from which a pair is flagged. Measured on the 162 pairs of the bank's correct alternatives
#: written in full (``code=``) and the solutions, cell by cell: six pairs that keep most of one
#: another's lines (two statements swapped, the ring turned the other way, the same steps into another
#: buffer) share 0.85 to 1.0, as a copy with renamed variables and new comments does (0.94 to 0.96 in
#: tests/test_similarity.py); all the others, which solve the problem another way, share at most 0.72
#: (the same collectives on the same chunks). 0.8 sits between. Four labs' own solutions score 0.81 to
#: 0.86 against the library (docs/INTEGRITY.md): the report shows that level next to a library pair.
THRESHOLD = 0.8
#: the tokeniser's language, by the name it is given
LEXER_NAME = "answer.py"


@dataclass
class Text:
    """One answer (a student's cell), or the library's answer for a lab (:func:`library_answer`)."""
    who: str                  # the student, or "minidist"
    lab: str
    notebook: str
    cell: str
    source: str
    library: bool = False
    units: list = field(default_factory=list)       # the library's: (start, end, "file: name")
    prints: dict = field(default_factory=dict)      # boilerplate key -> CodeFingerprint


@dataclass
class Pair:
    score: float
    a: Text                   # always a student's answer
    b: Text                   # a classmate's answer, or the library's
    slices: tuple             # copydetect's (a's slices, b's slices) of shared code


def _copydetect():
    from copydetect import CodeFingerprint, compare_files
    return CodeFingerprint, compare_files


def fingerprint(text: Text, boilerplate: tuple, key: str):
    if key not in text.prints:
        CodeFingerprint, _ = _copydetect()
        text.prints[key] = CodeFingerprint(LEXER_NAME, K, WINDOW, boilerplate=list(boilerplate), fp=io.StringIO(text.source))
    return text.prints[key]


@functools.lru_cache(maxsize=None)
def boilerplate_of(stub: str) -> tuple:
    """The fingerprints of what the release gives in a cell (every k-gram of it: copydetect's rule)."""
    if not stub.strip():
        return ()
    CodeFingerprint, _ = _copydetect()
    return tuple(sorted(CodeFingerprint(LEXER_NAME, K, 1, fp=io.StringIO(stub)).hashes))


def compare(a: Text, b: Text, stub: str = "", key: str = "") -> Pair:
    """The pair's score (see the module's docstring) and the slices of shared code."""
    _, compare_files = _copydetect()
    bp = boilerplate_of(stub)
    fa, fb = fingerprint(a, bp, key), fingerprint(b, bp, key)
    if not fa.hashes or not fb.hashes:
        return Pair(0.0, a, b, ((), ()))
    _, (sa, sb), slices = compare_files(fa, fb)
    score = float(sa) if b.library else max(float(sa), float(sb))
    return Pair(min(score, 1.0), a, b, slices)


# --------------------------------------------------------------------------- what is compared
def answers(out: Path, releases: dict) -> list[Text]:
    """Every solution code cell of every graded notebook in OUT/autograded, except one left as released."""
    import nbformat
    found = []
    for path in sorted((Path(out) / "autograded").glob("*/*/*.ipynb")):
        student, lab = path.parent.parent.name, path.parent.name
        try:
            nb = nbformat.read(str(path), as_version=4)
        except Exception:           # an unreadable notebook was graded 0; nothing to compare
            continue
        stubs = releases.get((lab, path.stem), {})
        for cell in nb.cells:
            meta = nbg(cell)
            if cell.get("cell_type") != "code" or not meta.get("solution") or not meta.get("grade_id"):
                continue
            source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
            if not source.strip() or normalized(source) == normalized(stubs.get(meta["grade_id"], "")):
                continue
            found.append(Text(student, lab, path.stem, meta["grade_id"], source))
    return found


def release_cells(out: Path, lab: str, notebook: str) -> dict:
    """{grade id: source} of the cells as released, the boilerplate: from OUT's gradebook (nbgrader keeps
    the release's source of every solution and locked cell: what the batch was graded against), else
    from the lab's released notebook in labs/."""
    from autograder.course import labs_dir, read_nb
    db = Path(out) / "gradebook.db"
    if db.is_file():
        try:        # read-only, with sqlite itself: nbgrader's Gradebook may migrate a file it opens
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                cells = dict(con.execute(
                    "SELECT source_cell.name, source_cell.source FROM source_cell JOIN notebook ON "
                    "source_cell.notebook_id = notebook.id JOIN assignment ON notebook.assignment_id = assignment.id "
                    "WHERE notebook.name = ? AND assignment.name = ?", (notebook, lab)).fetchall())
            if cells:
                return cells
        except sqlite3.Error:     # not a gradebook: the release's notebook, then
            pass
    path = labs_dir() / lab / f"{notebook}.ipynb"
    if not path.is_file():
        return {}
    return {nbg(c)["grade_id"]: c.source for c in read_nb(path).cells if nbg(c).get("grade_id")}


def library_answer(lab: str) -> Text | None:
    """The library's answer for ``lab``, as one text: the minidist modules its checks refuse (the lab's
    ``REFUSED``: one Refusal, or one per graded function), one after another, so that an answer that
    copies a function and the helpers it calls is compared with all of them at once. Code under
    ``minidist/checks/`` is left out, as the refusal leaves it out: a lab's reference is its solution.
    ``units``: (start, end, "file: name") of each top-level function and class, to say what matched."""
    from minidist.checks.kit.refused_code import Refusal, resolve
    try:
        checks = importlib.import_module(f"minidist.checks.{lab}")
    except ImportError:
        return None
    refused = getattr(checks, "REFUSED", None)
    refusals = [r for r in (refused.values() if isinstance(refused, dict) else [refused]) if isinstance(r, Refusal)]
    package = str(Path(importlib.import_module("minidist").__file__).parent) + os.sep
    files = sorted({f for r in refusals for f in resolve(r)[0]
                    if f.startswith(package) and not f.startswith(package + "checks" + os.sep)})
    if not files:
        return None
    parts, units, at = [], [], 0
    for path in files:
        rel = "minidist/" + os.path.relpath(path, package).replace(os.sep, "/")
        text = Path(path).read_text(encoding="utf-8").rstrip("\n") + "\n\n"
        head = f"# {rel}\n"
        lines = text.splitlines(keepends=True)
        starts = list(itertools.accumulate([0] + [len(line) for line in lines]))
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                units.append((at + len(head) + starts[first - 1], at + len(head) + starts[node.end_lineno],
                              f"{rel}: {node.name}"))
        parts.append(head + text)
        at += len(head) + len(text)
    return Text("minidist", lab, "", "", "".join(parts), library=True, units=units)


def matched_units(pair: "Pair") -> list[str]:
    """The library's functions and classes that hold the shared code of ``pair``, most shared first."""
    shared: dict[str, int] = {}
    for start, end in zip(*pair.slices[1]) if len(pair.slices[1]) else ():
        for lo, hi, label in pair.b.units:
            n = min(int(end), hi) - max(int(start), lo)
            if n > 0:
                shared[label] = shared.get(label, 0) + n
    return sorted(shared, key=lambda label: -shared[label])


def solution_score(lab: str, notebook: str, cell: str, library: Text, stub: str = "") -> float | None:
    """What the lab's own solution to ``cell`` (the source notebook in solutions/) scores against the
    library (``stub``: the cell as released): the level an honest answer written as the solution
    reaches, shown next to a student's."""
    from autograder.course import read_nb, solutions_dir, strip_solution_markers
    path = solutions_dir() / lab / f"{notebook}.ipynb"
    if not path.is_file():
        return None
    source = next((c.source for c in read_nb(path).cells if nbg(c).get("grade_id") == cell), None)
    if source is None:
        return None
    solution = Text("the lab's solution", lab, notebook, cell, strip_solution_markers(source))
    return compare(solution, library, stub, f"{lab}/{notebook}/{cell}").score


# --------------------------------------------------------------------------- the report
def find_pairs(out: Path) -> tuple[list[Pair], list[Text], dict]:
    """Every flagged pair of OUT's answers (score >= THRESHOLD), highest first, the answers, and the
    cells as released ({(lab, notebook): {grade id: source}})."""
    out = Path(out)
    keys = {(p.parent.name, p.stem) for p in (out / "autograded").glob("*/*/*.ipynb")}
    releases = {key: release_cells(out, *key) for key in keys}
    texts = answers(out, releases)
    library = {lab: library_answer(lab) for lab in {t.lab for t in texts}}
    pairs = []
    by_cell = {}
    for t in texts:
        by_cell.setdefault((t.lab, t.notebook, t.cell), []).append(t)
    for (lab, nb, cell), group in sorted(by_cell.items()):
        stub = releases.get((lab, nb), {}).get(cell, "")
        key = f"{lab}/{nb}/{cell}"
        for t in group:
            if library[lab] is not None:
                p = compare(t, library[lab], stub, key)
                if p.score >= THRESHOLD:
                    pairs.append(p)
        for a, b in itertools.combinations(group, 2):
            p = compare(a, b, stub, key)
            if p.score >= THRESHOLD:
                pairs.append(p)
    pairs.sort(key=lambda p: (-p.score, p.a.lab, p.a.cell, p.a.who, p.b.who))
    return pairs, texts, releases
