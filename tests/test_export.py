"""``python -m autograder export DIR --format canvas|moodle|csv``: the column layouts an LMS imports.

A batch's gradebook is made the way ``grade`` makes it (the fixture lab's template course, the
scores merged by :func:`autograder.gradebook.merge_gradebook`), without grading anything.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autograder_fixtures import LAB, SOLUTIONS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    from autograder.course import build_course, lab_cells
    from autograder.gradebook import merge_gradebook
    from autograder.records import Job
    old = os.environ.get("MINIDIST_SOLUTIONS")
    os.environ["MINIDIST_SOLUTIONS"] = str(SOLUTIONS)
    tmp = tmp_path_factory.mktemp("export")
    template = build_course([LAB], tmp / "template")
    metas = lab_cells(template, LAB)

    def job(student, points, submitted=True):
        cells = {nb: {m["name"]: {"points": points.get(m["name"], 0.0), "max_points": m["max_score"],
                                  "status": "pass" if points.get(m["name"]) else "fail", "reason": "",
                                  "flags": []} for m in ms} for nb, ms in metas.items()}
        j = Job(student, LAB, None, tmp / "none")
        j.result = {"cells": cells, "submitted": submitted}
        return j
    out = tmp / "out"
    out.mkdir()
    # alice: full marks; bob: handed in, only add right; carol: handed in, nothing right; dave: nothing handed in
    merge_gradebook(template, out, [job("alice", {"test_add": 1.0, "test_allsum": 2.0}), job("bob", {"test_add": 1.0}),
                                    job("carol", {}), job("dave", {}, submitted=False)])
    yield out
    os.environ.pop("MINIDIST_SOLUTIONS") if old is None else os.environ.__setitem__("MINIDIST_SOLUTIONS", old)


def export(out: Path, fmt: str, **kw) -> list[list[str]]:
    from autograder.export import export as run
    with open(run(out, fmt, **kw), newline="") as f:
        return list(csv.reader(f))


def test_canvas_layout(batch):
    rows = export(batch, "canvas")
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", LAB]
    assert rows[1][0] == "Points Possible" and rows[1][-1] == "3"
    by_login = {r[3]: r for r in rows[2:]}
    assert set(by_login) == {"alice", "bob", "carol", "dave"}
    assert [by_login[s][-1] for s in ("alice", "bob", "carol", "dave")] == ["3", "1", "0", ""]
    assert all(r[1] == "" and r[2] == "" for r in rows[2:])        # Canvas matches on SIS Login ID
    assert all(len(r) == len(rows[0]) for r in rows)
    rows = export(batch, "canvas", canvas_id="sis_user")
    assert {r[2] for r in rows[2:]} == {"alice", "bob", "carol", "dave"} and all(r[3] == "" for r in rows[2:])


def test_moodle_layout(batch):
    rows = export(batch, "moodle")
    assert rows[0] == ["Username", "Email address", LAB]
    assert {r[0]: r[2] for r in rows[1:]} == {"alice": "3", "bob": "1", "carol": "0", "dave": ""}


def test_csv_is_nbgraders_from_the_command_line(batch, tmp_path):
    r = subprocess.run([sys.executable, "-m", "autograder", "export", str(batch), "--format", "csv", "--to",
                        str(tmp_path / "g.csv")], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, MINIDIST_SOLUTIONS=str(SOLUTIONS)))
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "g.csv"), r.stderr[-2000:]
    with open(tmp_path / "g.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:11] == ["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
                            "raw_score", "late_submission_penalty", "score", "max_score"]
    assert {r[3]: r[9] for r in rows[1:]} == {"alice": "3.0", "bob": "1.0", "carol": "0.0", "dave": "0.0"}
