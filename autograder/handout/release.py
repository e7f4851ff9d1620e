"""``python -m autograder release``: regenerate labs/ from solutions/ with nbgrader."""
from __future__ import annotations

import filecmp
import shutil
import tempfile
from pathlib import Path

from autograder.course.labs import all_labs, labs_dir as default_labs_dir
from autograder.course.template import build_course


def fresh_release(labs: list[str], dest: Path) -> Path:
    """Run nbgrader generate_assignment in a private course; return its release/ dir."""
    return build_course(labs, dest) / "release"


def release(labs: list[str] | None = None, labs_dir: Path | None = None) -> list[str]:
    """Write labs_dir/<lab>/ for the given labs (default: all; stale labs are removed)."""
    labs_dir = labs_dir or default_labs_dir()
    every = all_labs()
    labs = list(labs) if labs else every
    with tempfile.TemporaryDirectory(prefix="minidist-release-") as tmp:
        rel = fresh_release(labs, Path(tmp) / "course")
        labs_dir.mkdir(parents=True, exist_ok=True)
        for lab in labs:
            shutil.rmtree(labs_dir / lab, ignore_errors=True)
            shutil.copytree(rel / lab, labs_dir / lab)
    if set(labs) == set(every):
        for p in labs_dir.iterdir():
            if p.is_dir() and p.name not in every:
                shutil.rmtree(p)
    return labs


def _tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()
            and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts}


def check(labs_dir: Path | None = None) -> list[str]:
    """Differences between labs_dir and a fresh release (empty list: up to date)."""
    labs_dir = labs_dir or default_labs_dir()
    every = all_labs()
    problems = []
    have = {p.name for p in labs_dir.iterdir() if p.is_dir()} if labs_dir.is_dir() else set()
    for extra in sorted(have - set(every)):
        problems.append(f"labs/{extra}/ has no source in solutions/")
    with tempfile.TemporaryDirectory(prefix="minidist-release-check-") as tmp:
        rel = fresh_release(every, Path(tmp) / "course") if every else None
        for lab in every:
            if lab not in have:
                problems.append(f"labs/{lab}/ is missing")
                continue
            a, b = _tree(rel / lab), _tree(labs_dir / lab)
            for f in sorted(a - b):
                problems.append(f"labs/{lab}/{f} is missing")
            for f in sorted(b - a):
                problems.append(f"labs/{lab}/{f} is not part of the release")
            for f in sorted(a & b):
                if not filecmp.cmp(rel / lab / f, labs_dir / lab / f, shallow=False):
                    problems.append(f"labs/{lab}/{f} differs from a fresh release")
    return problems
