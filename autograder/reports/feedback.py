"""``python -m autograder feedback OUT [--to DIR]``: check feedback for hidden-test leaks
and copy it per student for handing back."""
from __future__ import annotations

import html
import shutil
from pathlib import Path

from autograder.course.cells import read_nb
from autograder.course.hidden_tests import hidden_test_lines
from autograder.course.labs import solutions_dir


def collect(out: Path, to: Path | None = None) -> tuple[list[Path], list[str]]:
    """Returns (feedback files, leaks). Every file without a leak is copied to ``to``; one with a
    leak (a hidden-test line in it, e.g. quoted by the student's own code) is withheld alone, so
    that no submission's text can hold back anyone else's feedback."""
    fb = Path(out) / "feedback"
    hidden: dict[str, list[str]] = {}
    for src in solutions_dir().glob("*/*.ipynb"):
        hidden.setdefault(src.parent.name, []).extend(hidden_test_lines(read_nb(src)))
    files = sorted(fb.glob("*/*/*.html"))
    leaks, leaking = [], set()
    for f in files:
        lab = f.parent.name
        text = html.unescape(f.read_text(errors="replace"))
        found = [f"{f}: {line}" for line in hidden.get(lab, []) if line in text]
        leaks += found
        if found:
            leaking.add(f)
    made = []
    if to is not None:
        for f in files:
            if f in leaking:
                continue
            dest = Path(to) / f.relative_to(fb)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
            made.append(dest)
    return (made if to is not None else files), leaks
