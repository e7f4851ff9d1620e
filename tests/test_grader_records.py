"""What the grader accepts from a worker (autograder/grading/records.py), without grading anything:
points clamped to the template, unknown statuses and missing tests refused (that submission
only), and a killed worker's notebook points kept only as far as its confirmation confirmed."""
from pathlib import Path

import pytest

from autograder.grading.records import Job, checked_confirmation, checked_result, confirmed_only, fallback_cells

META = {"nb": [{"name": "t1", "max_score": 2.0, "kind": "test", "hidden": 0.0},
               {"name": "t2", "max_score": 1.0, "kind": "test", "hidden": 0.0},
               {"name": "essay", "max_score": 3.0, "kind": "manual", "hidden": 0.0}]}
JOB = Job("s", "lab", None, Path("/nonexistent"))


def row(points, status="pass"):
    return {"points": points, "status": status, "reason": "r", "flags": []}


def test_points_are_clamped_to_the_template_and_nan_is_zero():
    got = checked_result({"cells": {"nb": {"t1": row(1000.0), "t2": row(float("nan")),
                                           "essay": row(None, "manual")}}}, JOB, META)
    cells = got["cells"]["nb"]
    assert cells["t1"]["points"] == 2.0 and cells["t2"]["points"] == 0.0
    assert cells["essay"]["points"] is None and cells["essay"]["status"] == "manual"
    assert checked_result({"cells": {"nb": {"t1": row(-5.0), "t2": row(1.0), "essay": row(None, "manual")}}},
                          JOB, META)["cells"]["nb"]["t1"]["points"] == 0.0


@pytest.mark.parametrize("result", [
    None, {"cells": []}, {"cells": {}},
    {"cells": {"nb": {"t1": row(1.0)}}},                                               # a test missing
    {"cells": {"nb": {"t1": row(1.0, "bribed"), "t2": row(1.0), "essay": row(None, "manual")}}},
    {"cells": {"nb": {"t1": row("two"), "t2": row(1.0), "essay": row(None, "manual")}}},
])
def test_an_unreadable_result_is_refused(result):
    with pytest.raises((ValueError, TypeError, KeyError, AttributeError)):
        checked_result(result, JOB, META)


def test_a_killed_worker_keeps_only_confirmed_points():
    records = [{"event": "done", "index": 3, "grade_id": "t1", "points": 2.0, "status": "pass", "reason": "ok"},
               {"event": "done", "index": 5, "grade_id": "t2", "points": 1.0, "status": "pass", "reason": "ok"},
               {"event": "done", "index": "x", "grade_id": "t2", "points": 9.0}]        # malformed: ignored
    cells = fallback_cells(META, records, {}, "killed")
    assert cells["nb"]["t1"]["points"] == 2.0 and cells["nb"]["t2"]["points"] == 1.0
    confirmed_only(cells, {"nb": {"t1": 1.0, "t2": 0.0}}, META)    # the fraction of each part's points
    assert cells["nb"]["t1"]["points"] == 2.0
    assert cells["nb"]["t2"]["points"] == 0.0 and "not confirmed" in cells["nb"]["t2"]["reason"]
    cells = fallback_cells(META, records, {}, "killed")
    confirmed_only(cells, {}, META)                    # no report arrived before the worker ended
    assert all(cells["nb"][t]["points"] == 0.0 for t in ("t1", "t2"))
    assert checked_confirmation({"notebook": "nb", "points": {"t1": "2"}}) == ("nb", {})
    assert checked_confirmation({"notebook": "nb", "points": {"t1": 7.0}}) == ("nb", {"t1": 1.0})
    assert checked_confirmation({"notebook": 3, "points": {}}) is None


def test_a_killed_workers_hidden_part_scores_what_the_confirmation_reported():
    """A test cell with hidden tests is scored in two parts: the visible one as far as the notebook and
    the confirmation both give it, the hidden one from the confirmation alone (the kernel had no
    hidden cases) once the visible one has its points; a hidden part that fails costs its share only,
    and is no tampering."""
    meta = {"nb": [{"name": "t1", "max_score": 2.0, "kind": "test", "hidden": 1.0}]}
    records = [{"event": "done", "index": 3, "grade_id": "t1", "points": 2.0, "status": "pass", "reason": "ok"}]
    cells = fallback_cells(meta, records, {}, "killed")
    confirmed_only(cells, {"nb": {"t1": 1.0, "t1/hidden": 0.0}}, meta)
    row = cells["nb"]["t1"]
    assert row["points"] == 1.0 and row["status"] == "fail" and row["reason"].startswith("hidden tests")
    assert row["parts"]["visible"]["points"] == 1.0 and row["parts"]["hidden"]["points"] == 0.0
    assert not any("not confirmed" in f for f in row["flags"])
    cells = fallback_cells(meta, records, {}, "killed")
    confirmed_only(cells, {"nb": {"t1": 0.0, "t1/hidden": 1.0}}, meta)    # visible not confirmed: flagged
    row = cells["nb"]["t1"]
    assert row["points"] == 0.0 and row["parts"]["visible"]["points"] == 0.0
    assert row["parts"]["hidden"]["reason"] == "hidden tests: not scored (the visible tests did not pass)"
    assert any("not confirmed" in f for f in row["flags"])
    checked = checked_result({"cells": {"nb": {"t1": row}}}, JOB, meta)["cells"]["nb"]["t1"]
    assert checked["parts"] == row["parts"]
    forged = dict(row, parts={"visible": {"points": 1.0, "status": "pass"}, "hidden": {"points": 9.0, "status": "pass"}})
    assert "parts" not in checked_result({"cells": {"nb": {"t1": forged}}}, JOB, meta)["cells"]["nb"]["t1"]


def test_points_awaiting_manual_grading_are_shown_as_such_in_grades_csv(tmp_path):
    """Issue 29: a lab with a written answer (graded by hand) exports the automatic score and the
    points still to be graded by hand, so a perfect automatic solution does not read as 75 %."""
    import csv
    import shutil

    import nbformat

    from autograder.course.cells import read_nb, write_nb
    from autograder.course.template import build_course, lab_cells
    from autograder.grading.gradebook import export_csv, merge_gradebook
    from autograder_fixtures import LAB, SOLUTIONS
    shutil.copytree(SOLUTIONS, tmp_path / "solutions")
    path = tmp_path / "solutions" / LAB / f"{LAB}.ipynb"
    nb = read_nb(path)
    nb.cells.append(nbformat.v4.new_markdown_cell(
        "Why does a ring all-reduce send 2(n-1)/n of the data?\n\n### BEGIN SOLUTION\nBecause ...\n### END SOLUTION",
        metadata={"nbgrader": {"grade": True, "solution": True, "locked": False, "points": 3,
                               "grade_id": "essay", "schema_version": 3}}))
    write_nb(nb, path)
    course = build_course([LAB], tmp_path / "course", solutions=tmp_path / "solutions")
    meta = lab_cells(course, LAB)
    assert {c["name"]: c["kind"] for c in meta[LAB]}["essay"] == "manual"
    job = Job("alice", LAB, tmp_path, tmp_path / "job")
    job.result = {"cells": fallback_cells(meta, [], {}, "r")}
    for name, r in job.result["cells"][LAB].items():
        r.update(points=None, status="manual") if name == "essay" else r.update(points=r["max_points"], status="pass")
    (tmp_path / "out").mkdir()
    db = merge_gradebook(course, tmp_path / "out", [job])
    export_csv(db, tmp_path / "grades.csv")
    [row] = list(csv.DictReader(open(tmp_path / "grades.csv")))
    assert (row["score"], row["max_score"]) == ("3.0", "6.0")
    assert (row["manual_points_pending"], row["needs_manual_grade"]) == ("3", "True")
