"""What the grader accepts from a worker (autograder/records.py), without grading anything:
points clamped to the template, unknown statuses and missing tests refused (that submission
only), and a killed worker's notebook points kept only as far as its confirmation confirmed."""
from pathlib import Path

import pytest

from autograder.records import Job, checked_confirmation, checked_result, confirmed_only, fallback_cells

META = {"nb": [{"name": "t1", "max_score": 2.0, "kind": "test"},
               {"name": "t2", "max_score": 1.0, "kind": "test"},
               {"name": "essay", "max_score": 3.0, "kind": "manual"}]}
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
    confirmed_only(cells, {"nb": {"t1": 2.0, "t2": 0.0}})
    assert cells["nb"]["t1"]["points"] == 2.0
    assert cells["nb"]["t2"]["points"] == 0.0 and "not confirmed" in cells["nb"]["t2"]["reason"]
    cells = fallback_cells(META, records, {}, "killed")
    confirmed_only(cells, {})                          # no report arrived before the worker ended
    assert all(cells["nb"][t]["points"] == 0.0 for t in ("t1", "t2"))
    assert checked_confirmation({"notebook": "nb", "points": {"t1": "2"}}) == ("nb", {})
    assert checked_confirmation({"notebook": 3, "points": {}}) is None
