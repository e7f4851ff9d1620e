"""``python -m autograder export DIR --format canvas|moodle|csv``: the column layouts an LMS imports.

A batch's gradebook is made the way ``grade`` makes it (the fixture lab's template course, the
scores merged by :func:`autograder.grading.gradebook.merge_gradebook`), without grading anything.
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
    from autograder.course.template import build_course, lab_cells
    from autograder.grading.gradebook import merge_gradebook
    from autograder.grading.records import Job
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
    from autograder.reports.export import export as run
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
    assert rows[0] == ["Username", "Full name", "Email address", "ID number", f"{LAB} (max 3)"]
    assert {r[0]: r[-1] for r in rows[1:]} == {"alice": "3", "bob": "1", "carol": "0", "dave": ""}


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


# --------------------------------------------------------------------------- the roster
ROSTER = ("Login,Name,E-mail,LMS id,Section\n"
          "alice,\"Liddell, Alice\",alice@example.edu,1001,Sec 01\n"
          "bob,Bob Builder,bob@example.edu,1002,Sec 02\n"
          "carol,Carol Danvers,carol@example.edu,1003,Sec 01\n")


def roster_file(tmp_path, text=ROSTER, name="roster.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_roster_fills_the_canvas_file(batch, tmp_path):
    """Student, ID, Section from the roster, the login in SIS Login ID; dave, graded but not on the
    roster, keeps his row (login only) and is named in a warning."""
    import io
    warned = io.StringIO()
    rows = export(batch, "canvas", to=tmp_path / "c.csv", roster=roster_file(tmp_path), stream=warned)
    by_login = {r[3]: r for r in rows[2:]}
    assert by_login["alice"][:5] == ["Liddell, Alice", "1001", "", "alice", "Sec 01"]
    assert by_login["bob"][:5] == ["Bob Builder", "1002", "", "bob", "Sec 02"]
    assert by_login["dave"][:5] == ["dave", "", "", "dave", ""]
    assert [by_login[s][-1] for s in ("alice", "bob", "carol", "dave")] == ["3", "1", "0", ""]
    assert "not on the roster" in warned.getvalue() and "dave" in warned.getvalue()
    assert "alice" not in warned.getvalue()


def test_the_roster_fills_the_moodle_file_with_each_lab_s_maximum(batch, tmp_path):
    rows = export(batch, "moodle", to=tmp_path / "m.csv", roster=roster_file(tmp_path))
    assert rows[0] == ["Username", "Full name", "Email address", "ID number", f"{LAB} (max 3)"]
    by_login = {r[0]: r for r in rows[1:]}
    assert by_login["alice"] == ["alice", "Liddell, Alice", "alice@example.edu", "1001", "3"]
    assert by_login["bob"] == ["bob", "Bob Builder", "bob@example.edu", "1002", "1"]
    assert by_login["dave"] == ["dave", "", "", "", ""]
    rows = export(batch, "moodle", to=tmp_path / "p.csv", roster=roster_file(tmp_path), moodle_percent=True)
    assert rows[0][-1] == f"{LAB} (%)"
    assert {r[0]: r[-1] for r in rows[1:]} == {"alice": "100", "bob": "33.33", "carol": "0", "dave": ""}


def test_grade_stores_the_roster_and_export_reads_it(tmp_path):
    """``grade --roster`` (here on students who handed nothing in: no kernel runs) stores the roster in
    OUT, warns about a graded student it lacks, and ``export`` reads it; ``export --roster`` overrides it."""
    subs, out = tmp_path / "subs", tmp_path / "out"
    for student in ("alice", "zed"):
        (subs / student).mkdir(parents=True)
    roster = roster_file(tmp_path)
    r = subprocess.run([sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--lab", LAB,
                        "--roster", str(roster), "--quiet"], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, MINIDIST_SOLUTIONS=str(SOLUTIONS)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 student(s) graded but not on the roster" in r.stderr and "zed" in r.stderr
    assert (out / "roster.csv").read_text().splitlines()[0] == "login,name,email,lms_id,section"
    rows = export(out, "canvas")
    assert {r[3]: r[:2] for r in rows[2:]} == {"alice": ["Liddell, Alice", "1001"], "zed": ["zed", ""]}
    other = roster_file(tmp_path, "login,name\nzed,Zed Zebra\n", "other.csv")
    rows = export(out, "canvas", roster=other)
    assert {r[3]: r[0] for r in rows[2:]} == {"alice": "alice", "zed": "Zed Zebra"}


MALFORMED = {
    "no login column": ("name,email\nAlice,a@x.org\n", "line 1: no login column"),
    "an unknown column": ("login,name,mail\nalice,Alice,a@x.org\n", "line 1: unknown column(s) 'mail'"),
    "a column twice": ("login,email,E-mail\nalice,a@x.org,b@x.org\n", "line 1: column(s) email named twice"),
    "a short row": ("login,name,email\nalice,Alice\n", "line 2: 2 fields, the header has 3"),
    "a login twice": ("login,name\nalice,A\nbob,B\nalice,C\n", "line 4: login 'alice' already on line 2"),
    "no login": ("login,name\n,Alice\n", "line 2: no login"),
    "a bad e-mail": ("login,email\nalice,alice at x.org\n", "line 2: 'alice at x.org' is no e-mail address"),
    "an lms id twice": ("login,lms_id\nalice,7\nbob,7\n", "line 3: lms_id '7' already on line 2"),
    "a path as login": ("login\n../alice\n", "line 2: login '../alice' cannot be a student folder"),
    "only a header": ("login,name\n", "no students after the header"),
    "an empty file": ("", "empty; it needs a header row"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_roster_is_refused_with_a_clear_message(case, tmp_path):
    from autograder.grading.roster import read_roster
    text, message = MALFORMED[case]
    with pytest.raises(SystemExit) as err:
        read_roster(roster_file(tmp_path, text))
    assert str(err.value).startswith(f"roster {tmp_path / 'roster.csv'}: ") and message in str(err.value), str(err.value)


def test_a_malformed_roster_stops_grade_before_anything_is_graded(tmp_path, capsys):
    from autograder.__main__ import main
    subs, out = tmp_path / "subs", tmp_path / "out"
    (subs / "alice" / LAB).mkdir(parents=True)
    with pytest.raises(SystemExit) as err:
        main(["grade", str(subs), "--out", str(out), "--roster", str(roster_file(tmp_path, "name\nAlice\n"))])
    assert "no login column" in str(err.value) and not out.exists()
    rows = roster_file(tmp_path, "\ufeffLOGIN,Name\nalice,Alice\n", "bom.csv")       # a spreadsheet's UTF-8
    from autograder.grading.roster import read_roster
    assert read_roster(rows)["alice"].name == "Alice"


# --------------------------------------------------------------------------- Canvas's existing columns
def test_a_lab_goes_into_an_existing_canvas_column(batch, tmp_path):
    from autograder.__main__ import main
    dest = tmp_path / "c.csv"
    assert main(["export", str(batch), "--format", "canvas", "--to", str(dest),
                 "--canvas-column", f'{LAB}="Lab 1 (123456)"']) == 0
    with open(dest, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Lab 1 (123456)"]
    assert {r[3]: r[-1] for r in rows[2:]} == {"alice": "3", "bob": "1", "carol": "0", "dave": ""}
    mapping = tmp_path / "columns.txt"
    mapping.write_text(f"# lab = Canvas column\n{LAB}=Toy lab, part 1 (99)\n")
    from autograder.reports.export import canvas_columns
    rows = export(batch, "canvas", to=dest, columns=canvas_columns(file=mapping))
    assert rows[0][-1] == "Toy lab, part 1 (99)"


@pytest.mark.parametrize("value, message", [
    (f"{LAB}=Lab 1", "an existing Canvas assignment's column as Canvas names it, 'Name (id)'"),
    ("Lab 1 (123456)", "expected LAB=COLUMN"),
    ("lab9=Lab 9 (5)", "no lab 'lab9' in this batch; its labs: toylab"),
])
def test_a_wrong_canvas_column_is_refused(batch, tmp_path, value, message):
    from autograder.__main__ import main
    with pytest.raises(SystemExit) as err:
        main(["export", str(batch), "--format", "canvas", "--to", str(tmp_path / "c.csv"), "--canvas-column", value])
    assert message in str(err.value), str(err.value)
    assert not (tmp_path / "c.csv").exists()


@pytest.mark.parametrize("args, message", [
    (["--format", "moodle", "--canvas-column", f"{LAB}=Lab 1 (1)"], "are for --format canvas, not moodle"),
    (["--format", "csv", "--roster", "r.csv"], "--roster is for --format canvas or moodle"),
    (["--format", "canvas", "--moodle-percent"], "--moodle-percent is for --format moodle, not canvas"),
])
def test_an_option_of_another_format_is_refused(batch, tmp_path, args, message):
    from autograder.__main__ import main
    with pytest.raises(SystemExit) as err:
        main(["export", str(batch), "--to", str(tmp_path / "x.csv")] + args)
    assert message in str(err.value) and not (tmp_path / "x.csv").exists()
