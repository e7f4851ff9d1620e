"""nbgrader's two runs in a job: ``autograde``, the kernel in the sandbox, and ``generate_feedback``.

:func:`autograde` runs the lab's notebook(s) as handed in (the locked cells and hidden tests put back
by nbgrader) and scores each test from the progress records its kernel's replies produce, in this
process (:class:`~autograder.grading.worker.nbext.ProgressExecute`, :func:`notebook_cells`):
nothing the kernel writes decides a score. Where nbgrader could not finish, the tests that ran keep
their points and the rest get the reason (:func:`autograder.grading.records.fallback_cells`); a test
that timed out runs once more with longer timeouts (:func:`retry_timeouts`). :func:`generate_feedback`
writes nbgrader's feedback without hidden tests (:class:`~autograder.grading.worker.nbext.HideHiddenTests`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from autograder.course.cells import grade_id, nbg, read_nb
from autograder.course.config import load_config
from autograder.course.template import run_converter
from autograder.grading.records import KERNEL_NOT_STARTED, fallback_cells, finished_cells, last_started, valid_record
from autograder.grading.worker.notebooks import classify
from autograder.grading.worker.retry import RETRY_TIMEOUT_SCALE, overrides
from autograder.grading.worker.submission import HandedIn, JobCourse
from autograder.sandbox.kernel import KernelJob, kernel_manager


def autograde_config(course: Path, cell_timeout: int, kernel: KernelJob, sink):
    """nbgrader's configuration for one run of ``autograde``: this job's kernels (:class:`KernelJob`, in
    the sandbox where there is one) and its progress records to ``sink``."""
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, IgnorePattern,
                                        LimitOutput, SaveAutoGrades)

    from autograder.grading.worker.nbext import ProgressExecute, TruncateOutput, with_sink

    c = load_config(root=course)
    c.Execute.timeout = int(cell_timeout)
    c.Autograde.autograde_preprocessors = [
        with_sink(sink), IgnorePattern, ClearMetadataPreprocessor, LimitOutput, TruncateOutput,
        SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
    c[ProgressExecute.__name__].kernel_manager_class = kernel_manager(kernel)
    return c


def feedback_config(course: Path, release_tests: dict):
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import GetGrades

    from autograder.grading.worker.nbext import TruncateOutput, hiding

    c = load_config(root=course)
    c.HTMLExporter.template_name = "feedback"
    c.GenerateFeedback.preprocessors = [hiding(release_tests), TruncateOutput, GetGrades,
                                        CSSHTMLHeaderPreprocessor]
    return c


def autograde(course: JobCourse, handed: HandedIn, kernel: KernelJob, spec: dict, deadline: float, send) -> dict:
    """The job's result before the confirmation: ``{"student", "lab", "notes", "cells", "graded", "failure"}``,
    the cells scored from the progress records (each also sent as ``progress``, so that the supervisor has
    them if this worker never finishes)."""
    from nbgrader.converters import Autograde

    records: list[dict] = []

    def sink(rec):
        records.append(rec)
        send({"type": "progress", **rec})
    lab, student = course.lab, course.student
    result = {"student": student, "lab": lab, "notes": handed.notes, "cells": {}, "graded": False,
              "failure": None}
    if len(handed.unusable) < len(course.names):
        c = autograde_config(course.root, spec["cell_timeout"], kernel, sink)
        r = run_converter(Autograde, c, lab, student, force=True, create_student=True)
        (course.job / "autograde.log").write_text(r.get("log", "") + "\n" + r.get("error", ""))
        if r["success"]:
            result["graded"] = True
        else:
            result["failure"] = failure_reason(r.get("log", "") + "\n" + r.get("error", ""), records,
                                               _sandbox_errors(course.job / "worker.log"))
    if result["graded"]:
        result["cells"] = notebook_cells(course.root, lab, student, course.cells_meta, handed.unusable, records,
                                         handed.cell_flags, spec["cell_timeout"])
        retry_timeouts(result["cells"], course.root, lab, student, course.cells_meta, handed.unusable,
                       handed.cell_flags, spec, deadline, kernel)
    else:
        result["cells"] = fallback_cells(course.cells_meta, records, handed.unusable, result["failure"] or "",
                                         handed.cell_flags)
    return result


def notebook_cells(course, lab, student, cells_meta, unusable, records, cell_flags, cell_timeout) -> dict:
    """Per test cell: the points nbgrader's rules give it, from the progress records (computed in
    this process as the kernel replied), never from files a kernel could have written."""
    from nbgrader.utils import determine_grade, is_grade
    done = finished_cells(records)
    out = {}
    for name, cells in cells_meta.items():
        by_id = {}
        if name not in unusable:
            try:
                ag = read_nb(course / "autograded" / student / lab / f"{name}.ipynb")
                by_id = {grade_id(c): c for c in ag.cells}
            except Exception:
                by_id = {}
        rows = {}
        for meta in cells:
            flags = cell_flags.get(name, {}).get(meta["name"], [])
            mx = meta["max_score"]
            if name in unusable:
                pts, status, reason = 0.0, "error", unusable[name]
            elif meta["kind"] == "manual":
                pts, status, reason = None, "manual", "needs manual grading"
            else:
                d = done.get(meta["name"])
                if d is not None:
                    pts, status, reason = d["points"], d["status"], d["reason"]
                else:                        # a cell nbgrader did not execute (should not happen)
                    cell = by_id.get(meta["name"])
                    pts = determine_grade(cell)[0] if cell is not None and is_grade(cell) else 0.0
                    status, reason = classify(cell, pts, mx, cell_timeout)
                pts = min(max(float(pts or 0.0), 0.0), mx)
            rows[meta["name"]] = {"points": pts, "max_points": mx, "status": status, "reason": reason,
                                  "flags": list(flags)}
        out[name] = rows
    return out


def failure_reason(log: str, records: list[dict], sandbox_errors: list[str] = ()) -> str:
    """One line: why nbgrader could not finish, and in which cell. ``sandbox_errors``: what the sandbox
    said while starting the kernel (its ``sandbox: ...`` lines); a kernel that died before its first
    cell with one of those never ran the submission at all."""
    last = last_started(records)
    where = f" while running cell {last!r}" if last else ""
    low = log.lower()
    died = "kernel died" in low or "deadkernel" in low or "dead kernel" in low
    if (died or sandbox_errors) and not any(valid_record(r) and r["event"] == "start" for r in records):
        # no cell had been sent to it: nothing of the submission ran (a kernel's start is the grader's)
        return (KERNEL_NOT_STARTED + " (a problem of the grading machine, not of the submission; "
                "`python -m autograder doctor` checks the sandbox)" +
                (f": {sandbox_errors[-1][:200]}" if sandbox_errors else ""))
    if died:
        return f"the kernel died (crash, os._exit or killed){where}"
    if "timeout" in low:
        return f"the kernel stopped responding after the cell timeout{where}"
    lines = [l for l in log.strip().split("\n") if l.strip()]
    return f"nbgrader autograde failed{where}: " + (lines[-1].strip()[:200] if lines else "unknown error")


def _sandbox_errors(log: Path) -> list[str]:
    """What the sandbox wrote while failing to start a kernel (``sandbox: could not ...``: its tools write
    to the worker's log, which the kernel inherits)."""
    try:
        sys.stderr.flush()
        text = log.read_text(errors="replace")[-200_000:]
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.startswith("sandbox: ")]


def retry_timeouts(cells: dict, course, lab, student, cells_meta, unusable, cell_flags, spec, deadline,
                   kernel: KernelJob) -> None:
    """A test that timed out in the notebook run gets the second chance (:mod:`autograder.grading.worker.retry`):
    the notebook runs once more, its kernel's launch timeouts and the cell timeout x ``RETRY_TIMEOUT_SCALE``
    (a loaded machine is no deadlock; a deadlock times out at any scale), and a timed-out test keeps the
    better of its two results (in place)."""
    from nbgrader.converters import Autograde
    timed_out = [(n, cid) for n, rows in cells.items() for cid, row in rows.items() if row["status"] == "timeout"]
    if not timed_out or time.time() > deadline - 60:
        return
    records: list[dict] = []
    again_kernel = dataclasses.replace(kernel, env={**kernel.env, **overrides({**os.environ, **kernel.env})})
    c = autograde_config(course, spec["cell_timeout"] * RETRY_TIMEOUT_SCALE, again_kernel, records.append)
    r = run_converter(Autograde, c, lab, student, force=True, create_student=True)
    if not r["success"]:
        return
    again = notebook_cells(course, lab, student, cells_meta, unusable, records, cell_flags,
                           spec["cell_timeout"] * RETRY_TIMEOUT_SCALE)
    for name, cid in timed_out:
        first, second = cells[name][cid], again.get(name, {}).get(cid)
        if second is not None and float(second["points"] or 0) > float(first["points"] or 0):
            cells[name][cid] = dict(second, flags=first["flags"] + [
                f"timed out in the notebook run; passed when run again with timeouts x{RETRY_TIMEOUT_SCALE}"])


def generate_feedback(course: JobCourse, result: dict) -> None:
    """nbgrader's feedback for the job (its test cells as released: no hidden tests, tracebacks cut); a
    failure is noted in ``result``, with the log next to the job's."""
    from nbgrader.converters import GenerateFeedback

    release_tests = {grade_id(c): c.source for nb in course.release_nbs.values() for c in nb.cells
                     if grade_id(c) and nbg(c).get("grade") and not nbg(c).get("solution")}
    c = feedback_config(course.root, release_tests)
    fr = run_converter(GenerateFeedback, c, course.lab, course.student, force=True)
    if not fr["success"]:
        result["notes"].append("feedback generation failed")
        (course.job / "feedback.log").write_text(fr.get("log", "") + "\n" + fr.get("error", ""))
