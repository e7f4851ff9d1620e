"""What the grader accepts from a worker: progress records and the result, checked.

A worker (:mod:`autograder.grading.worker`) reports through a pipe only; what arrives is checked here
against the template course before it counts: every test of every notebook present, points
clamped to [0, the template's maximum], statuses known, texts short. A record that is not what
the grader sends is ignored; a result that cannot be read costs that submission (with the
reason), never the batch. When nbgrader never finished, the cells that did keep the points
their progress records carry (computed in the worker from the kernel's replies,
:func:`fallback_cells`). The worker's own per-test points come from the same records
(:func:`autograder.grading.worker.autograde.notebook_cells`), never from files a kernel could have
written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


STATUSES = {"pass", "fail", "error", "timeout", "manual"}
#: how a failure's reason begins when the kernel never started (the grading machine's failure,
#: :func:`autograder.grading.worker.autograde.failure_reason`)
KERNEL_NOT_STARTED = "the kernel could not start"


def valid_record(r) -> bool:
    """A progress record as ProgressExecute makes it (anything else is ignored)."""
    return (isinstance(r, dict) and r.get("event") in ("start", "done") and isinstance(r.get("index"), int)
            and (r.get("grade_id") is None or isinstance(r.get("grade_id"), str)))


def last_started(records: list[dict]):
    """Label of the cell that was started last and never finished (or None)."""
    recs = [r for r in records if valid_record(r)]
    done = {r["index"] for r in recs if r["event"] == "done"}
    started = [r for r in recs if r["event"] == "start" and r["index"] not in done]
    if not started:
        return None
    r = started[-1]
    return r.get("grade_id") or f"#{r['index'] + 1}"


def finished_cells(records: list[dict]) -> dict:
    """{grade_id: record} of the graded cells that finished, with the points they scored."""
    return {r["grade_id"]: r for r in records
            if valid_record(r) and r["event"] == "done" and r.get("grade_id")
            and isinstance(r.get("points"), (int, float))}


def fallback_cells(cells_meta, records: list[dict], unusable: dict, reason: str, cell_flags=None,
                   status_unrun: str = "error") -> dict:
    """Per-cell results when nbgrader never finished: cells that completed keep the score
    nbgrader's rules gave them; the rest get 0 with ``reason``."""
    done = finished_cells(records)
    out = {}
    for name, cells in cells_meta.items():
        rows = {}
        for meta in cells:
            d = done.get(meta["name"])
            flags = (cell_flags or {}).get(name, {}).get(meta["name"], [])
            if name in unusable:
                row = (0.0, "error", unusable[name])
            elif d is not None:
                row = (min(max(float(d["points"]), 0.0), meta["max_score"]), str(d.get("status", "fail"))[:20],
                       str(d.get("reason", ""))[:300])
            else:  # never finished: the stuck cell or one after it
                row = (0.0, status_unrun, reason or "not run")
            rows[meta["name"]] = {"points": row[0], "max_points": meta["max_score"],
                                  "status": row[1], "reason": row[2], "flags": list(flags)}
        out[name] = rows
    return out


def grader_fault(result: dict) -> str | None:
    """Why grading failed for the grader's own sake, or None (it did not fail, or failed for the
    submission's: a timeout, a kernel the submission killed). The grader's: a result marked
    ``grader_failed`` (an exception in the core, a worker that ended without a result or sent an
    unreadable one, the grader stopped), or a kernel that never started."""
    failure = result.get("failure")
    if result.get("grader_failed") or (isinstance(failure, str) and failure.startswith(KERNEL_NOT_STARTED)):
        return str(failure or "the grader failed")
    return None


def confirmed_only(cells: dict, confirmed: dict, cells_meta: dict) -> None:
    """The grader's fallback rows (the worker was killed or failed before its result) when the
    batch confirms: each test is scored by the one rule (:func:`autograder.confirm.points.score_row`)
    from the confirmation's own report (``confirmed``: {notebook: {confirmation id: fraction}}, received
    before the worker ended); without a report a test keeps nothing. Otherwise a submission could pass
    patched tests in the kernel and then stall past the wall-clock limit, before its confirmation was
    applied."""
    from autograder.confirm.points import score_row
    from autograder.course.hidden_tests import HIDDEN_PART
    why = "its points there, reported before the worker was stopped"
    for nb, rows in cells.items():
        got = confirmed.get(nb)
        metas = {m["name"]: m for m in cells_meta.get(nb, [])}
        for cid, row in rows.items():
            if row["status"] == "manual" or cid not in metas:
                continue
            if got is None:
                if float(row["points"] or 0.0) > 0:
                    row.update(points=0.0, status="error",
                               reason="not confirmed: the submission was stopped before its confirmation run ended")
                continue
            parts = {"visible": (float(got.get(cid, 0.0)), why)}
            if metas[cid].get("hidden"):
                parts["hidden"] = (float(got.get(cid + HIDDEN_PART, 0.0)), why)
            score_row(row, metas[cid], parts)


def checked_confirmation(msg) -> tuple[str, dict] | None:
    """(notebook, {confirmation id: fraction of its points}) from a worker's confirmation report
    (fractions clamped to [0, 1]), or None if malformed."""
    nb, points = msg.get("notebook"), msg.get("points")
    if not isinstance(nb, str) or not isinstance(points, dict):
        return None
    return nb, {str(k): min(1.0, max(0.0, float(v))) for k, v in points.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def checked_result(result, job: Job, cells_meta: dict) -> dict:
    """The worker's result, checked against the template: every test of every notebook present,
    points numbers clamped to [0, the template's maximum], statuses known, texts short."""
    if not isinstance(result, dict) or not isinstance(result.get("cells"), dict):
        raise ValueError("no per-test results")
    cells = {}
    for nb, metas in cells_meta.items():
        got = result["cells"].get(nb)
        if not isinstance(got, dict):
            raise ValueError(f"no results for notebook {nb!r}")
        rows = {}
        for meta in metas:
            row = got.get(meta["name"])
            if not isinstance(row, dict):
                raise ValueError(f"no result for test {meta['name']!r}")
            status = str(row.get("status"))
            if status not in STATUSES:
                raise ValueError(f"unknown status {status!r}")
            pts = row.get("points")
            if status == "manual" and pts is None:
                pass
            else:
                pts = float(pts or 0.0)
                if pts != pts:                                  # NaN
                    pts = 0.0
                pts = min(max(pts, 0.0), float(meta["max_score"]))
            flags = row.get("flags") or []
            rows[meta["name"]] = {"points": pts, "max_points": float(meta["max_score"]), "status": status,
                                  "reason": str(row.get("reason", ""))[:400].replace("\n", " "),
                                  "flags": [str(f)[:400] for f in flags][:20] if isinstance(flags, list) else [],
                                  "confirmed": str(row.get("confirmed", ""))[:300]}
            parts = checked_parts(row.get("parts"), meta, pts)
            if parts:
                rows[meta["name"]]["parts"] = parts
        cells[nb] = rows
    notes = result.get("notes") or []
    late = result.get("late_penalty") or {}
    out = {"student": job.student, "lab": job.lab, "graded": bool(result.get("graded")),
           "failure": None if result.get("failure") is None else str(result["failure"])[:400],
           "notes": [str(n)[:600] for n in notes][:40] if isinstance(notes, list) else [],
           "cells": cells, "submitted": True,
           "timestamp": result.get("timestamp") if isinstance(result.get("timestamp"), str) else None,
           "late_penalty": {str(k): max(0.0, float(v)) for k, v in late.items()
                            if k in cells_meta and isinstance(v, (int, float))} if isinstance(late, dict) else {},
           "confirmation": result.get("confirmation") if isinstance(result.get("confirmation"), dict) else {}}
    for nb, info in (out["confirmation"].get("notebooks") or {}).items():
        if isinstance(info, dict):
            out["notes"] += [str(n)[:600] for n in info.get("notes", [])][:6]
    return out


def checked_parts(parts, meta: dict, points) -> dict | None:
    """A test's parts as the worker reports them (:mod:`autograder.course.hidden_tests`), checked: exactly the
    test's parts, each clamped to its share, adding up to the test's points; else None (no parts)."""
    from autograder.course.hidden_tests import shares
    share = shares(meta)
    if not isinstance(parts, dict) or set(parts) != set(share) or points is None:
        return None
    out = {}
    for part, top in share.items():
        p = parts[part]
        if not isinstance(p, dict) or str(p.get("status")) not in STATUSES:
            return None
        pts = float(p.get("points") or 0.0) if isinstance(p.get("points"), (int, float)) else 0.0
        out[part] = {"points": min(max(pts if pts == pts else 0.0, 0.0), top), "max_points": top,
                     "status": str(p["status"]), "reason": str(p.get("reason", ""))[:400].replace("\n", " ")}
    if abs(sum(p["points"] for p in out.values()) - points) > 1e-6:
        return None
    return out


@dataclass
class Job:
    student: str
    lab: str
    submission_dir: Path | None
    job_dir: Path
    result: dict = field(default_factory=dict)
    seconds: float = 0.0
