"""Each lab's bug bank stays with the course (issue 61): it sits beside the lab's solution
(``solutions/<lab>/bugbank.py``), and nothing that leaves the instructor's machine holds it: not the
release (``labs/``, made by nbgrader, which copies every other file of a lab's folder), not the
course a submission is graded in, not the installed package (the wheel of this repository). The
platforms' bundles and the student distribution are searched for it in ``test_handed_out.py`` and
``test_student_dist.py``; plain nbgrader's release in ``test_nbgrader_plain.py``."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from autograder.course.config import load_config
from autograder.course.labs import BANK_FILE, all_labs, bank_file
from autograder.course.template import build_course
from autograder.handout import release
from autograder_fixtures import LAB, SOLUTIONS

ROOT = Path(__file__).resolve().parents[1]


def test_every_lab_s_bank_sits_beside_its_solution_and_nowhere_else():
    labs = all_labs(ROOT / "solutions")
    assert len(labs) >= 10
    assert all(bank_file(lab, ROOT / "solutions").is_file() for lab in labs)
    elsewhere = [p for part in ("autograder", "minidist", "labs") for p in (ROOT / part).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and (p.name == BANK_FILE or "bugbank" in p.parts)]
    assert elsewhere == []
    assert BANK_FILE in load_config().CourseDirectory.ignore         # plain nbgrader's release leaves it out


def test_a_release_and_the_course_a_submission_is_graded_in_leave_the_bank_out(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_SOLUTIONS", str(SOLUTIONS))
    assert bank_file(LAB).is_file()                                   # the fixture lab has one
    course = build_course([LAB], tmp_path / "course")
    assert (course / "source" / LAB / f"{LAB}.ipynb").is_file() and not list(course.rglob(BANK_FILE))
    labs = tmp_path / "labs"
    assert release.release([LAB], labs_dir=labs) == [LAB]
    assert (labs / LAB / f"{LAB}.ipynb").is_file() and not list(labs.rglob(BANK_FILE))


def test_the_built_wheel_holds_no_bank(tmp_path):
    """The repository's own wheel (its pyproject, as `pip wheel .` builds it), from a copy of the checkout."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info", "build")
    src.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    for part in ("minidist", "autograder", "solutions"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(tmp_path / "wheels"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("minidist-*.whl")
    members = zipfile.ZipFile(wheel).namelist()
    assert "autograder/__main__.py" in members and "minidist/__init__.py" in members     # the whole package
    assert [m for m in members if "bugbank" in m or m.startswith("solutions/")] == []
