"""A test cell's two parts, its visible tests and its hidden tests, and how its points are split.

A lab's test cell holds its visible tests, which a student runs, and between ``### BEGIN HIDDEN
TESTS`` and ``### END HIDDEN TESTS`` its hidden ones, which only the grader runs. The grader scores
each part on its own: the visible part as the student's kernel and the confirmation both find it, the
hidden part in the confirmation alone (the kernel has no hidden cases,
:mod:`minidist.checks.kit.withheld`). So a mistake only the hidden cases reveal costs the hidden
part's points, not the visible part's, and a platform can show the visible part's result at once and
the hidden part's after the due date (Gradescope's ``visibility``) without one giving the other away.

The cell's points (nbgrader's ``points``) are split: the hidden part gets
``metadata["minidist"]["hidden_points"]`` where the source notebook gives it, else half; the visible
part the rest. A cell without hidden tests is one part worth all its points.

The lines of the hidden tests are what no feedback may show (:func:`hidden_test_lines`: the feedback
check of ``python -m autograder feedback`` and the selftest search for them).
"""
from __future__ import annotations

BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
#: the confirmation's id of a test cell's hidden part (the visible part keeps the cell's grade id)
HIDDEN_PART = "/hidden"
PARTS = ("visible", "hidden")


def split(source: str) -> tuple[str, str]:
    """(the visible tests, the hidden tests) of a test cell's source; each keeps its own lines only,
    the markers dropped (a test cell without hidden tests: its whole source and "")."""
    visible, hidden, inside = [], [], False
    for line in source.split("\n"):
        if BEGIN_HIDDEN in line:
            inside = True
        elif END_HIDDEN in line:
            inside = False
        else:
            (hidden if inside else visible).append(line)
    return "\n".join(visible).strip("\n"), "\n".join(hidden).strip("\n")


def has_hidden(source: str) -> bool:
    return bool(split(source)[1].strip())


def hidden_points(cell, points: float) -> float:
    """The hidden part's points of a test cell worth ``points`` (0 for a cell without hidden tests)."""
    visible, hidden = split(cell.get("source", ""))
    if not hidden.strip():
        return 0.0
    if not visible.strip():             # hidden tests alone: the whole cell is the hidden part
        return float(points)
    given = ((cell.get("metadata") or {}).get("minidist") or {}).get("hidden_points")
    if isinstance(given, (int, float)) and not isinstance(given, bool) and 0 <= given <= points:
        return float(given)
    return points / 2


def shares(meta: dict) -> dict:
    """{part: its maximum points} of one test (``meta``: a ``lab_cells`` entry, with ``hidden``)."""
    hidden = float(meta.get("hidden") or 0.0)
    out = {"visible": float(meta["max_score"]) - hidden}
    if hidden:
        out["hidden"] = hidden
    return out


def hidden_test_lines(nb) -> list[str]:
    """Non-trivial source lines inside hidden-test regions of a source notebook."""
    out = []
    for cell in nb.cells:
        inside = False
        for line in cell.source.split("\n"):
            if BEGIN_HIDDEN in line:
                inside = True
            elif END_HIDDEN in line:
                inside = False
            elif inside and len(line.strip()) >= 8:
                out.append(line.strip())
    return out
