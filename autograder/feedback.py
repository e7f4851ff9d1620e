"""``python -m autograder feedback OUT [--to DIR]``: check feedback for hidden-test leaks
and copy it per student for handing back."""
from __future__ import annotations

import html
import shutil
from pathlib import Path

from autograder.course import hidden_test_lines, read_nb, solutions_dir


def collect(out: Path, to: Path | None = None) -> tuple[list[Path], list[str]]:
    """Returns (feedback files, leaks).  Files are copied to ``to`` only if nothing leaks."""
    fb = Path(out) / "feedback"
    hidden: dict[str, list[str]] = {}
    for src in solutions_dir().glob("*/*.ipynb"):
        hidden.setdefault(src.parent.name, []).extend(hidden_test_lines(read_nb(src)))
    files = sorted(fb.glob("*/*/*.html"))
    leaks = []
    for f in files:
        lab = f.parent.name
        text = html.unescape(f.read_text(errors="replace"))
        leaks += [f"{f}: {line}" for line in hidden.get(lab, []) if line in text]
    made = []
    if to is not None and not leaks:
        for f in files:
            dest = Path(to) / f.relative_to(fb)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
            made.append(dest)
    return (made if to is not None else files), leaks
