"""The confirmation's points, and the one rule that combines them with the notebook's.

A test keeps its notebook points only as far as the confirmation gives them: ``min(notebook,
confirmed)`` (:func:`lower_to_confirmed`, the only place that applies it: after a finished
confirmation, :func:`confirm_cells`, and for a worker killed before it applied one, from the points
the confirmation reported first, :func:`autograder.records.confirmed_only`). A test that passed in
the notebook and fails here scores the confirmation's points (0 for a failed test) and is flagged
``not confirmed: tampering suspected``; honest submissions score the same in both runs, so they
keep exactly their notebook scores. A confirmation that does not confirm a test runs it once more,
alone, with the timeouts of :mod:`autograder.retry`, before the verdict.
"""
from __future__ import annotations

import time

import nbformat

NOT_CONFIRMED = "not confirmed: tampering suspected"


def confirmed_points(outcome: dict | None, max_points: float) -> tuple[float, str]:
    """(points, why) the confirmation gives one test, by nbgrader's rules (``determine_grade``)."""
    from nbgrader.utils import determine_grade
    if outcome is None:
        return 0.0, "the confirmation run did not reach this test"
    outputs = []
    if outcome.get("error"):
        ename, evalue = (list(outcome["error"]) + ["", ""])[:2]
        outputs.append(nbformat.v4.new_output("error", ename=str(ename), evalue=str(evalue), traceback=[]))
    if outcome.get("stderr"):
        outputs.append(nbformat.v4.new_output("stream", name="stderr", text=str(outcome["stderr"])))
    if outcome.get("value") is not None:
        outputs.append(nbformat.v4.new_output("execute_result", data={"text/plain": str(outcome["value"])},
                                              execution_count=1))
    cell = nbformat.v4.new_code_cell("", outputs=outputs)
    cell.metadata["nbgrader"] = {"grade": True, "solution": False, "points": max_points, "grade_id": "x"}
    try:
        points, _ = determine_grade(cell)
    except Exception:
        points = 0.0
    points = min(float(points or 0.0), max_points)
    if outcome.get("changed"):
        return 0.0, "the test's checks or torch were changed while it ran: " + ", ".join(outcome["changed"][:3])
    if outcome.get("error"):
        ename, evalue = (list(outcome["error"]) + ["", ""])[:2]
        return points, f"{ename}: {str(evalue).strip().splitlines()[0][:200] if str(evalue).strip() else ''}".rstrip(": ")
    if outcome.get("stderr") and points < max_points:
        return points, "wrote to stderr: " + str(outcome["stderr"]).strip()[:120]
    return points, "passed"


def lower_to_confirmed(row: dict, points: float, why: str) -> None:
    """The one rule, on one test's row (in place): it keeps its notebook points only as far as the
    confirmation gives them. A test that passed in the notebook and scores less here is flagged, fails,
    and scores the confirmation's ``points``; ``why``: what the confirmation saw."""
    if float(row["points"] or 0) > points:
        row["flags"].append(f"{NOT_CONFIRMED} (passed in the notebook; in a fresh interpreter: {why})")
        row.update(points=points, status="fail", reason=f"{NOT_CONFIRMED}: {why}"[:300])


def confirm_cells(cells: dict, runs: dict, start, deadline) -> dict:
    """Apply the confirmation to the notebook's per-test results (in place); returns a summary."""
    summary = {"ran": True, "notebooks": {}}
    for name, run in runs.items():
        run.wait()
        res = run.results()
        rows = cells.get(name, {})
        unconfirmed = _unconfirmed(rows, res)
        attempts = 1
        if unconfirmed and time.time() < deadline - 10:       # once more, alone: a loaded machine is no tamperer
            retry = start(name, only=set(unconfirmed), retry=True)
            retry.wait()
            res2 = retry.results()
            attempts = 2
            for cid in unconfirmed:
                if cid in res2["tests"]:
                    res["tests"][cid] = res2["tests"][cid]
            res["flags"] += res2["flags"]
            unconfirmed = _unconfirmed(rows, res)
        for cid, row in rows.items():
            if row["status"] == "manual":
                continue
            pts, why = confirmed_points(res["tests"].get(cid), row["max_points"])
            if not res["done"] and cid not in res["tests"]:
                why = f"the confirmation run stopped before this test (exit {res['exit']})"
            row["confirmed"] = why if pts >= float(row["points"] or 0) else f"failed: {why}"
            lower_to_confirmed(row, pts, why)
        notes = []
        if res["restored"]:
            notes.append("the solution cells changed minidist/torch (put back before the tests): "
                         + "; ".join(res["restored"][:6]))
        if res["flags"]:
            seen = []
            for f in res["flags"]:
                if f not in seen:
                    seen.append(f)
            notes.append("the confirmation run saw (no score change): " + "; ".join(": ".join(f) for f in seen[:10]))
        summary["notebooks"][name] = {"attempts": attempts, "done": res["done"], "notes": notes,
                                      "unconfirmed": unconfirmed}
    return summary


def _unconfirmed(rows, res) -> list[str]:
    out = []
    for cid, row in rows.items():
        if row["status"] == "manual":
            continue
        pts, _ = confirmed_points(res["tests"].get(cid), row["max_points"])
        if float(row["points"] or 0) > pts:
            out.append(cid)
    return out


def report_points(runs: dict, cells_meta: dict, send) -> None:
    """As each notebook's confirmation run ends, send its points per test to the grader
    (``{"type": "confirmation", ...}``): if the worker is then killed at the wall-clock limit, the
    grader keeps a test's notebook points only as far as these confirm them."""
    for name, run in runs.items():
        run.wait()
        res = run.results()
        send({"type": "confirmation", "notebook": name,
              "points": {m["name"]: confirmed_points(res["tests"].get(m["name"]), m["max_score"])[0]
                         for m in cells_meta.get(name, []) if m["kind"] != "manual"}})
