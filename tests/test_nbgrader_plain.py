"""Plain nbgrader in a course directory set up as autograder/README.md says ("With nbgrader"): lab 1's
solution and release, graded by ``nbgrader autograde`` alone, score what this grader gives them
(every test full marks, every test 0: what ``selftest`` checks of this grader), the cells tagged
``demo`` are not run, and ``nbgrader generate_feedback`` shows no hidden-test source."""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAB = "lab1_collectives"

pytestmark = pytest.mark.timeout(900)

CONFIG = """c = get_config()
load_subconfig({config!r})
c.CourseDirectory.root = {root!r}
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.db_url = "sqlite:///" + {db!r}
"""


def nbgrader(course: Path, *args) -> None:
    exe = Path(sys.executable).parent / "nbgrader"
    env = dict(os.environ, PATH=f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("MINIDIST_SOLUTIONS", None)
    r = subprocess.run([str(exe), *args], cwd=course, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_plain_nbgrader_scores_like_this_grader(tmp_path):
    from nbgrader.api import Gradebook

    from autograder.course.cells import read_nb, solution_submission, write_nb
    from autograder.selftest.bank import load_bank

    course = tmp_path / "course"
    shutil.copytree(REPO / "solutions" / LAB, course / "source" / LAB)
    (course / "nbgrader_config.py").write_text(CONFIG.format(config=str(REPO / "autograder" / "course" / "nbgrader_config.py"),
                                                             root=str(course), db=str(course / "gradebook.db")))
    nbgrader(course, "generate_assignment", LAB, "--force")
    src = read_nb(course / "source" / LAB / f"{LAB}.ipynb")
    rel = read_nb(course / "release" / LAB / f"{LAB}.ipynb")
    write_nb(solution_submission(src, rel), course / "submitted" / "sol" / LAB / f"{LAB}.ipynb")
    write_nb(rel, course / "submitted" / "rel" / LAB / f"{LAB}.ipynb")
    nbgrader(course, "autograde", LAB)
    nbgrader(course, "generate_feedback", LAB)
    # the lab's bug bank, copied into source/ with the lab, reaches neither the release nor a graded folder
    assert (course / "source" / LAB / "bugbank.py").is_file()
    assert not list((course / "release").rglob("bugbank.py")) and not list((course / "autograded").rglob("bugbank.py"))

    may_pass = set(load_bank(LAB)["RELEASE_MAY_PASS"])
    with Gradebook("sqlite:///" + str(course / "gradebook.db")) as gb:
        for student in ("sol", "rel"):
            nb = gb.find_submission_notebook(LAB, LAB, student)
            grades = {g.name: (g.auto_score, g.max_score) for g in nb.grades}
            assert grades
            for name, (score, mx) in grades.items():
                if student == "sol":
                    assert score == mx, (name, score, mx)
                elif name not in may_pass:
                    assert score == 0, (name, score)

    # the demo cells were blanked before the notebook ran
    demos = [c for c in read_nb(course / "autograded" / "sol" / LAB / f"{LAB}.ipynb").cells
             if "demo" in c.metadata.get("tags", [])]
    assert demos and all(c.source.startswith("# a demo cell") and not c.get("outputs") for c in demos)
    # the feedback shows no hidden-test line
    hidden = [line.strip() for c in src.cells for line in c.source.split("BEGIN HIDDEN TESTS", 1)[-1]
              .split("END HIDDEN TESTS", 1)[0].splitlines() if "BEGIN HIDDEN TESTS" in c.source and line.strip()
              and not line.strip().startswith("#")]
    assert hidden
    autograded = "\n".join(c.source for c in read_nb(course / "autograded" / "sol" / LAB / f"{LAB}.ipynb").cells)
    assert any(h in autograded for h in hidden)         # nbgrader restored them: the feedback must cut them
    for student in ("sol", "rel"):
        page = (course / "feedback" / student / LAB / f"{LAB}.html").read_text()
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        assert "Autograder" in text or LAB in text
        assert not [h for h in hidden if h in text], student
