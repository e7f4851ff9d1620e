"""``python -m autograder similarity OUT``: which graded answers look copied, for a person to read.

After ``grade`` wrote OUT, every answer cell of every graded notebook (an nbgrader solution cell, by
its grade id, as ``OUT/autograded/<student>/<lab>/<notebook>.ipynb`` holds it) is compared with the
library (everything the course ships that a student could copy: every module of the installed minidist
package, ``minidist/checks/`` included, :mod:`autograder.reports.similarity_library`) and with every
classmate's answer to the same cell.

The comparison is copydetect's: each text is tokenised, names become one letter (renaming a variable
changes nothing), comments and spacing are dropped, and the k-grams of what is left are hashed and
winnowed (Schleimer, Wilkerson and Aiken, "Winnowing: local algorithms for document fingerprinting",
SIGMOD 2003, the method of MOSS; here with a window of 1, see ``WINDOW``): every run of ``K`` shared
characters is seen. What the release already gives in the cell (the signature, the docstring; as OUT's
gradebook recorded it) is boilerplate and never counts. A cell's score is the share of an answer's
fingerprinted tokens found in the other text: against the library, the student's share (the library
holds far more); between classmates, the larger of the two shares (one copy may add code).

The results are grouped by pair (:class:`Pair`: two students, or a student and ``minidist``), each with
every cell the two share and its score (:class:`Match`): a pair is flagged when one of its cells scores
``THRESHOLD`` or more, and listed as a near miss, not flagged, from ``NEAR_MISS``. It flags for review
and changes no score (:mod:`autograder.reports.similarity_report` writes the report and ``results.csv``'s
``similarity`` column).
"""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from autograder.course.cells import nbg, normalized
from autograder.reports import similarity_library

#: k-gram size, in characters of the filtered text (a name is one character, an operator one or two):
#: 25 is about one line of code such as ``V.V(V[V],V=V,V=V)``. Shorter k-grams match the idioms every
#: answer to a lab shares (``dist.get_rank(group)``); longer ones miss copies of short answers.
K = 25
#: winnowing window: 1 keeps every k-gram's hash. A wider window keeps the smallest hash of each window,
#: and Python salts its string hash per process (copydetect hashes with ``hash``), so which k-grams are
#: kept, and the scores, would change from one run to the next; an answer cell is short enough to keep all.
WINDOW = 1
#: the score from which a cell, and its pair, is flagged. Measured on the 162 pairs of the bank's correct
#: alternatives written in full (``code=``) and the solutions, cell by cell: six pairs that keep most of
#: one another's lines (two statements swapped, the ring turned the other way, the same steps into
#: another buffer) share 0.85 to 1.0, as a copy with renamed variables and new comments does (0.94 to
#: 0.96 in tests/test_similarity.py); all the others, which solve the problem another way, share at most
#: 0.72 (the same collectives on the same chunks). 0.8 sits between. Some labs' own solutions score 0.8
#: or more against the library (docs/INTEGRITY.md): the report shows that level next to a library pair.
THRESHOLD = 0.8
#: the default score from which a pair that is not flagged is listed below the flagged ones, as a near
#: miss (``similarity --near-miss``): the independent alternatives above reach 0.72
NEAR_MISS = 0.6
#: the tokeniser's language, by the name it is given
LEXER_NAME = "answer.py"
#: who the library is, in a pair
LIBRARY = "minidist"


@dataclass
class Text:
    """One answer (a student's cell), or the library (:func:`library_text`)."""
    who: str                  # the student, or "minidist"
    lab: str
    notebook: str
    cell: str
    source: str
    library: bool = False
    units: list = field(default_factory=list)       # the library's: (start, end, "file: name")
    prints: dict = field(default_factory=dict)      # boilerplate key -> CodeFingerprint


@dataclass(eq=False)          # compared by identity: a deep comparison of slices is never wanted
class Match:
    """One cell compared: a student's answer and a classmate's answer to it, or the library."""
    score: float
    a: Text                   # always a student's answer
    b: Text                   # a classmate's answer, or the library
    slices: tuple             # copydetect's (a's slices, b's slices) of shared code


@dataclass(eq=False)
class Pair:
    """Two students, or a student and the library: every cell they share, highest score first."""
    a: str
    b: str                    # a classmate, or LIBRARY
    matches: list
    library: bool = False     # b is the library (a student's folder may be called anything)

    @property
    def score(self) -> float:
        return max((m.score for m in self.matches), default=0.0)

    @property
    def flagged(self) -> bool:
        return self.score >= THRESHOLD


def _copydetect():
    from copydetect import CodeFingerprint, compare_files
    return CodeFingerprint, compare_files


def fingerprint(text: Text, boilerplate: tuple, key: str):
    if text.library:          # one for every cell: the answer's side leaves the boilerplate out
        return text.prints[""]
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


def compare(a: Text, b: Text, stub: str = "", key: str = "") -> Match:
    """The cell's score (see the module's docstring) and the slices of shared code."""
    _, compare_files = _copydetect()
    bp = boilerplate_of(stub)
    fa, fb = fingerprint(a, bp, key), fingerprint(b, bp, key)
    if not fa.hashes or not fb.hashes:
        return Match(0.0, a, b, ((), ()))
    _, (sa, sb), slices = compare_files(fa, fb)
    score = float(sa) if b.library else max(float(sa), float(sb))
    return Match(min(score, 1.0), a, b, slices)


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
    from autograder.course.cells import read_nb
    from autograder.course.labs import labs_dir
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


def library_text() -> Text:
    """The library as one text (:func:`autograder.reports.similarity_library.library`: every module of the
    installed minidist package, its checks included), fingerprinted once per process."""
    source, units, prints = similarity_library.library(K, LEXER_NAME)
    return Text(LIBRARY, "", "", "", source, library=True, units=units, prints={"": prints})


def matched_units(match: Match) -> list[str]:
    """The library's functions and classes that hold the shared code of ``match``, most shared first."""
    return similarity_library.matched_units(match.slices[1], match.b.units) if match.b.library else []


@functools.lru_cache(maxsize=None)
def solution_score(lab: str, notebook: str, cell: str, stub: str = "") -> float | None:
    """What the lab's own solution to ``cell`` (the source notebook in solutions/) scores against the
    library (``stub``: the cell as released): the level an honest answer written as the solution
    reaches, shown next to a student's."""
    from autograder.course.cells import read_nb, strip_solution_markers
    from autograder.course.labs import solutions_dir
    path = solutions_dir() / lab / f"{notebook}.ipynb"
    if not path.is_file():
        return None
    source = next((c.source for c in read_nb(path).cells if nbg(c).get("grade_id") == cell), None)
    if source is None:
        return None
    solution = Text("the lab's solution", lab, notebook, cell, strip_solution_markers(source))
    return compare(solution, library_text(), stub, f"{lab}/{notebook}/{cell}").score


# --------------------------------------------------------------------------- the pairs
def find_pairs(out: Path, near_miss: float = NEAR_MISS) -> tuple[list[Pair], list[Text], dict]:
    """The pairs of OUT (two students, or a student and the library) whose highest cell scores
    ``near_miss`` or more, each with every cell the two share; highest first (so the flagged ones,
    from THRESHOLD, come first). Also the answers, and the cells as released
    ({(lab, notebook): {grade id: source}})."""
    out = Path(out)
    keys = {(p.parent.name, p.stem) for p in (out / "autograded").glob("*/*/*.ipynb")}
    releases = {key: release_cells(out, *key) for key in keys}
    texts = answers(out, releases)
    library = library_text() if texts else None
    by_cell: dict[tuple, list[Text]] = {}
    by_student: dict[str, dict[tuple, Text]] = {}
    for t in texts:
        by_cell.setdefault((t.lab, t.notebook, t.cell), []).append(t)
        by_student.setdefault(t.who, {})[(t.lab, t.notebook, t.cell)] = t
    found: dict[tuple[str, str], dict[tuple, Match]] = {}      # (a, b) -> {cell: match}
    for cell, group in sorted(by_cell.items()):
        stub, key = releases.get(cell[:2], {}).get(cell[2], ""), "/".join(cell)
        for t in group:                 # one per answer: every library match is kept
            found.setdefault((t.who, ""), {})[cell] = compare(t, library, stub, key)   # "": no folder's name
        for a, b in itertools.combinations(sorted(group, key=lambda t: t.who), 2):
            m = compare(a, b, stub, key)
            if m.score >= near_miss:
                found.setdefault((a.who, b.who), {})[cell] = m
    pairs = []
    for (a, b), cells in found.items():
        if max(m.score for m in cells.values()) < near_miss:
            continue
        if b:                           # two students: the pair's other shared cells, whatever they score
            for cell in (by_student[a].keys() & by_student[b].keys()) - cells.keys():
                cells[cell] = compare(by_student[a][cell], by_student[b][cell],
                                      releases.get(cell[:2], {}).get(cell[2], ""), "/".join(cell))
        pairs.append(Pair(a, b or LIBRARY, sorted(cells.values(), key=lambda m: (-m.score, m.a.lab, m.a.notebook,
                                                                                  m.a.cell)), library=not b))
    pairs.sort(key=lambda p: (-p.score, p.a, p.b))
    return pairs, texts, releases
