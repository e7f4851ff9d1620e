"""What ``grade`` writes reads well at class scale, checked without grading: the batch's facts once in
``batch.json``, not on each of results.csv's rows; one note for a notebook handed in from the source
instead of a "restored" flag per cell; an ETA in the progress line. (tests/test_autograder.py checks
the same on a graded batch.)"""
from __future__ import annotations

import copy
import csv
import io
import json
from pathlib import Path

from autograder.course.cells import grade_id, read_nb
from autograder.grading.records import Job
from autograder.grading.worker.notebooks import FROM_SOURCE, load, repair

REPO = Path(__file__).resolve().parent.parent
LAB = "lab1_collectives"
SANDBOX = "bubblewrap 0.8.0: user, pid, ipc, uts, cgroup and network namespaces, no new privileges, read-only system"


def test_results_rows_leave_the_batch_s_facts_to_batch_json(tmp_path):
    from autograder.grading.results import write_results
    jobs = []
    for student in ("ann", "ben"):
        j = Job(student, LAB, None, tmp_path / student)
        j.result = {"cells": {LAB: {"test_a": {"points": 1.0, "max_points": 1.0, "status": "pass", "reason": "passed",
                                               "flags": [], "confirmed": "1/1"}}},
                    "notes": ["late by 2 h"] if student == "ben" else [], "graded": True}
        jobs.append(j)
    meta = {"labs": [LAB], "jobs": 2, "cell_timeout_s": 120, "wall_clock_limit_s": 600.0, "sandbox": SANDBOX,
            "confirmation": True, "due_dates": {}, "seconds": 3.0}
    write_results(tmp_path, jobs, meta)
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 2 and "sandbox" not in rows[0] and rows[0]["similarity"] == ""
    assert not any(SANDBOX in v or "bubblewrap" in v for r in rows for v in r.values())
    assert [r["flags"] for r in rows] == ["", "late by 2 h"]        # a submission's own notes stay on its rows
    facts = json.loads((tmp_path / "batch.json").read_text())
    assert facts["sandbox"] == SANDBOX and facts["rows"] == 2 and facts["submissions"] == 2
    assert json.loads((tmp_path / "results.json").read_text())["sandbox"] == SANDBOX


def test_a_notebook_from_the_source_gets_one_note_and_a_tampered_one_its_flags():
    source = load(REPO / "solutions" / LAB / f"{LAB}.ipynb")
    release = read_nb(REPO / "labs" / LAB / f"{LAB}.ipynb")
    _, flags, notes = repair(copy.deepcopy(source), release, source)
    locked = sum(1 for c in release.cells if (c.metadata.get("nbgrader") or {}).get("locked"))   # every one put back
    assert locked >= 10 and flags == {} and notes == [FROM_SOURCE.format(n=locked)], notes
    _, flags, _ = repair(copy.deepcopy(source), release)                 # without the source: a flag per cell
    assert sum("restored" in f for fl in flags.values() for f in fl) >= 10
    edited = copy.deepcopy(release)
    test = next(c for c in edited.cells if grade_id(c) == "test_ring_all_reduce_correct")
    test.source = "assert True"
    _, flags, notes = repair(edited, release, source)
    assert flags == {"test_ring_all_reduce_correct": ["locked cell was modified; restored"]} and notes == []


def test_progress_shows_an_eta():
    from autograder.grading.grade import Progress
    stream = io.StringIO()
    bar = Progress(4, stream=stream)
    assert "ETA" not in stream.getvalue()                     # nothing finished: no rate yet
    bar.t0 -= 30
    bar.step("ann/lab1")
    assert "ETA 1m" in stream.getvalue().splitlines()[-1]     # 30 s for 1 of 4: about 90 s left
    assert bar.eta(now=bar.t0 + 10) == " ETA 0m30s"
    bar.done = 4
    assert bar.eta() == ""
