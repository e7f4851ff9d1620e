"""A course notebook's cells as nbgrader marks them: notebooks read and written, a cell's nbgrader
metadata and grade id, the solution regions, and the cells a lab tags ``demo``."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
DEMO_TAG = "demo"


def read_nb(path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def write_nb(nb, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def nbg(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def grade_id(cell):
    return nbg(cell).get("grade_id")


def normalized(src: str) -> str:
    """A cell's source as compared: surrounding blank lines and trailing spaces dropped."""
    return "\n".join(l.rstrip() for l in src.strip().split("\n"))


def strip_solution_markers(source: str) -> str:
    """The code a perfect student would type: solution markers removed, dedent kept."""
    return "\n".join(l for l in source.split("\n")
                     if BEGIN_SOLUTION not in l and END_SOLUTION not in l)


def solution_submission(source_nb, release_nb):
    """A release notebook with every solution cell filled in from the source notebook."""
    sol = {grade_id(c): c for c in source_nb.cells if nbg(c).get("solution")}
    nb = json.loads(json.dumps(release_nb))  # deep copy
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        gid = grade_id(cell)
        if gid in sol:
            cell.source = strip_solution_markers(sol[gid].source)
    return nb


def skip_demos(nb):
    """Blank the cells a lab tags ``demo``: deadlock demonstrations, benchmarks and plots
    that teach but grade nothing. They would only add seconds to every graded submission."""
    for cell in nb.cells:
        if cell.cell_type == "code" and DEMO_TAG in cell.get("metadata", {}).get("tags", []):
            cell.source = "# a demo cell: the grader does not run it"
    return nb
