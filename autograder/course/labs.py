"""Where the course is: its source labs (``solutions/``), its release (``labs/``), a lab by its name,
and each lab's bug bank.

A lab is a folder ``solutions/<lab>/`` that holds the nbgrader source notebook ``<lab>.ipynb``, and
beside it the lab's bug bank, :data:`BANK_FILE` (the selftest's: realistic mistakes and correct
alternatives, solutions/BUGBANK.md). The bank is the course's and is never handed out: the release
(nbgrader's ``CourseDirectory.ignore`` in the course configuration, and the template course, which
never copies it), the platforms' grading files and the student distribution all leave it out.
``$MINIDIST_SOLUTIONS`` and ``$MINIDIST_LABS`` move both folders (the tests point them at the fixture
course; ``python -m autograder --solutions DIR --labs-dir DIR`` sets them).
"""
from __future__ import annotations

import os
from pathlib import Path

from autograder import REPO

SOLUTIONS = REPO / "solutions"
LABS = REPO / "labs"
#: a lab's bug bank, beside its source notebook: solutions/<lab>/bugbank.py
BANK_FILE = "bugbank.py"


def solutions_dir() -> Path:
    """solutions/ (or $MINIDIST_SOLUTIONS: tests point it at a fixture course)."""
    return Path(os.environ.get("MINIDIST_SOLUTIONS") or SOLUTIONS)


def labs_dir() -> Path:
    return Path(os.environ.get("MINIDIST_LABS") or LABS)


def bank_file(lab: str, solutions: Path | None = None) -> Path:
    """The bug bank of ``lab``: ``solutions/<lab>/bugbank.py`` (it may not exist)."""
    return (solutions or solutions_dir()) / lab / BANK_FILE


def all_labs(solutions: Path | None = None) -> list[str]:
    """Labs = directories solutions/<lab>/ that hold <lab>.ipynb."""
    solutions = solutions or solutions_dir()
    if not solutions.is_dir():
        return []
    return sorted(p.name for p in solutions.iterdir()
                  if p.is_dir() and (p / f"{p.name}.ipynb").is_file())


def lab_notebooks(lab: str, solutions: Path | None = None) -> list[str]:
    """Notebook names (without .ipynb) of a lab's source directory."""
    solutions = solutions or solutions_dir()
    return sorted(p.stem for p in (solutions / lab).glob("*.ipynb"))


def resolve_lab(name: str, labs: list[str] | None = None) -> str:
    """A lab by its full name, or for short by its number or prefix: ``1`` and ``lab1`` are
    ``lab1_collectives``. Anything else names the labs there are."""
    labs = all_labs() if labs is None else labs
    if name in labs:
        return name
    short = f"lab{name}" if name.isdigit() else name
    found = [lab for lab in labs if lab.split("_")[0] == short]
    if len(found) == 1:
        return found[0]
    raise ValueError(f"no lab {name!r}; the labs are: {', '.join(labs) or '(none under solutions/)'}")
