"""A wheel of the minidist library alone (its ``minidist*`` packages, no grader), built from this checkout
without fetching anything: what the student distribution hands out, less every lab's hidden case
tables, and what a platform bundle installs on the grading machine, less them too (the grader gives
them to the confirmation, :mod:`autograder.confirm.hidden_tables`).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from autograder import REPO


def hidden_tables(root: Path = REPO) -> list[Path]:
    """Every lab's hidden case table under ``root`` (the files the student wheel leaves out)."""
    return sorted((root / "minidist" / "checks").glob("*/hidden.py"))


def wheel_problems(wheel: Path) -> list[str]:
    """What must not be in the student wheel and is: anything outside minidist/ and its metadata,
    a lab's hidden cases."""
    problems = []
    for name in zipfile.ZipFile(wheel).namelist():
        top, *rest = name.split("/")
        if top != "minidist" and not top.endswith(".dist-info"):
            problems.append(f"{name}: not part of the minidist package")
        elif top == "minidist" and rest[:1] == ["checks"] and rest[-1] == "hidden.py":
            problems.append(f"{name}: a lab's hidden cases")
    return problems


def minidist_wheel(dest: Path, leave_out=(), readme: str | None = None) -> Path:
    """A wheel of the library alone (``minidist*`` packages), built from this checkout without
    fetching anything (the interpreter's setuptools). ``leave_out``: files under minidist/ the wheel
    must not hold (the student wheel's hidden case tables, :mod:`autograder.handout.student_dist`);
    ``readme``: the wheel's description (``pip show``, an index page), else this repository's README."""
    left_out = {Path(p).resolve() for p in leave_out}

    def ignore(folder, names):
        return {n for n in names if n in ("__pycache__", ".ipynb_checkpoints") or n.endswith(".pyc")
                or (Path(folder) / n).resolve() in left_out}

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="minidist-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        text = (REPO / "pyproject.toml").read_text()
        include = 'include = ["minidist*", "autograder*"]'
        if include not in text:
            raise SystemExit(f"pyproject.toml: expected {include!r} to build a wheel of minidist alone")
        (src / "pyproject.toml").write_text(text.replace(include, 'include = ["minidist*"]'))
        (src / "README.md").write_text(readme if readme is not None else (REPO / "README.md").read_text())
        shutil.copytree(REPO / "minidist", src / "minidist", ignore=ignore)
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-w", str(dest), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit("building the minidist wheel failed:\n" + (r.stderr or r.stdout)[-2000:])
    wheels = sorted(dest.glob("minidist-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one minidist wheel in {dest}, found {[w.name for w in wheels]}")
    return wheels[0]
