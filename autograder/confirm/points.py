"""The confirmation's points, and the one rule that combines them with the notebook's.

A test cell is scored in two parts (:mod:`autograder.course.hidden_tests`). Its **visible** part keeps its
notebook points only as far as the confirmation gives them: ``min(notebook, confirmed)``; a part that
passed in the notebook and fails here scores the confirmation's points (0 for a failed test) and is
flagged ``not confirmed: tampering suspected``; honest submissions score the same in both runs, so they
keep exactly their notebook scores. Its **hidden** part runs in the confirmation only (the kernel has no
hidden cases) and scores what the confirmation gives it, once the visible part has its points; a failure
there is an ordinary failure, with the confirmation's reason. :func:`score_row` applies both to one test's row, the only place that does:
after a finished confirmation (:func:`confirm_cells`), and for a worker killed before it applied one,
from the points the confirmation reported first (:func:`autograder.grading.records.confirmed_only`). A part the
confirmation lowers (the visible part below the notebook's, a hidden part that timed out) runs once
more, alone, with the timeouts of :mod:`autograder.grading.worker.retry`, before the verdict.
"""
from __future__ import annotations

import time

import nbformat

from autograder.course.hidden_tests import HIDDEN_PART, shares

NOT_CONFIRMED = "not confirmed: tampering suspected"


def confirmed_points(outcome: dict | None, max_points: float) -> tuple[float, str]:
    """(points, why) the confirmation gives one test (a part of a test cell), by nbgrader's rules
    (``determine_grade``)."""
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


def said_by_grader(why: str) -> str:
    """What of the confirmation's ``why`` a visible part's result may show: the grader's own words and an
    error's type, never an error's message. The confirmation's child holds the hidden cases; a visible
    function that raised there with a message of its choosing could otherwise print them where the
    student sees them at once (the instructor reads the whole of it in ``results.csv``'s ``confirmed``)."""
    head, sep, _ = why.partition(": ")
    if sep and head.replace("_", "").isalnum() and head[:1].isupper():
        return f"{head} (its message is in the instructor's results)"
    return why


def timed_out(outcome: dict | None) -> bool:
    """Whether the confirmation's outcome of a part is a timeout (a deadlock, or a loaded machine): the cell's
    own timeout, or a launch that ran out of time (its error says so below its first line, as
    :func:`autograder.grading.worker.notebooks.classify` reads a notebook's)."""
    ename, evalue = (list((outcome or {}).get("error") or []) + ["", ""])[:2]
    return ename == "CellTimeoutError" or (ename == "LaunchError" and any(
        w in str(evalue) for w in ("timed out", "deadlock", "stuck", "still running")))


def score_row(row: dict, meta: dict, confirmed: dict) -> None:
    """The one rule, on one test's row (in place). ``confirmed``: {part: (fraction of its points the
    confirmation gives, why)} for the parts the confirmation ran (``meta``: the test's
    :func:`autograder.course.template.lab_cells` entry). The row's ``points`` are the notebook's on entry (its
    visible part's: the kernel left the hidden tests to the confirmation); on return, the sum of its
    parts', with ``parts``: {part: {points, max_points, status, reason}}."""
    share = shares(meta)
    full = float(meta["max_score"]) or 1.0
    notebook = float(row["points"] or 0.0) / full          # the notebook's fraction: its visible part's
    v_frac, v_why = confirmed.get("visible", (0.0, "the confirmation run did not reach this test"))
    visible = {"max_points": share["visible"], "status": row["status"], "reason": row["reason"],
               "points": share["visible"] * min(notebook, 1.0)}
    if visible["points"] > share["visible"] * v_frac + 1e-9:
        shown = said_by_grader(v_why)
        row["flags"].append(f"{NOT_CONFIRMED} (passed in the notebook; in a fresh interpreter: {shown})")
        visible.update(points=share["visible"] * v_frac, status="fail", reason=f"{NOT_CONFIRMED}: {shown}"[:300])
    parts = {"visible": visible}
    if "hidden" in share and visible["points"] < share["visible"] - 1e-9:
        # the hidden cases only count past the visible ones: a cell the notebook never passed (a kernel its own
        # code killed before the test, a function wrong on the visible cases) earns nothing of its hidden part
        parts["hidden"] = {"max_points": share["hidden"], "points": 0.0, "status": "fail",
                           "reason": "hidden tests: not scored (the visible tests did not pass)"}
    elif "hidden" in share:
        h_frac, h_why = confirmed.get("hidden", (0.0, "the confirmation run did not reach this test"))
        parts["hidden"] = {"max_points": share["hidden"], "points": share["hidden"] * h_frac,
                           "status": "pass" if h_frac >= 1 else "fail",
                           "reason": "passed" if h_frac >= 1 else f"hidden tests: {h_why}"[:300]}
    for part in parts.values():
        part["points"] = round(part["points"], 6)
    lost = [p for p in parts.values() if p["points"] < p["max_points"] - 1e-9]
    row.update(points=round(sum(p["points"] for p in parts.values()), 6), parts=parts,
               status=lost[0]["status"] if lost else row["status"], reason=lost[0]["reason"] if lost else row["reason"])
    if lost and row["status"] == "pass":
        row["status"] = "fail"


def lowered(row: dict, meta: dict, tests: dict, sound: bool) -> list[str]:
    """The confirmation's ids of the parts of one test it lowers (run once more before the verdict): the
    visible part below the notebook's points; a hidden part that timed out (as a notebook's test that
    timed out runs again, :mod:`autograder.grading.worker.retry`), or failed in a run that was not ``sound`` (the lab's
    own cells failed there, or it stopped early: a loaded machine's doing, not the submission's)."""
    if row["status"] == "manual":
        return []
    cid, out = meta["name"], []
    notebook = float(row["points"] or 0.0) / (float(meta["max_score"]) or 1.0)
    if notebook > confirmed_points(tests.get(cid), 1.0)[0]:
        out.append(cid)
    if meta.get("hidden") and notebook >= 1:        # only a hidden part that could count (its visible part passed)
        outcome = tests.get(cid + HIDDEN_PART)
        if confirmed_points(outcome, 1.0)[0] < 1 and (timed_out(outcome) or not sound):
            out.append(cid + HIDDEN_PART)
    return out


def sound(res: dict) -> bool:
    """Whether a confirmation run reached its end with every one of the lab's own cells (setup, given)
    run without an error: a test that failed there failed on its own account."""
    return bool(res["done"]) and not any(c.get("error") for c in res["cells"].values()
                                         if c.get("kind") in ("setup", "given"))


def part_outcomes(meta: dict, tests: dict, done: bool, exit_code=None) -> dict:
    """{part: (fraction, why)} of one test from a confirmation's results (``tests``: {id: outcome})."""
    out = {}
    for part, cid in (("visible", meta["name"]), ("hidden", meta["name"] + HIDDEN_PART)):
        if part == "hidden" and not meta.get("hidden"):
            continue
        frac, why = confirmed_points(tests.get(cid), 1.0)
        if not done and cid not in tests:
            why = f"the confirmation run stopped before this test (exit {exit_code})"
        out[part] = (frac, why)
    return out


def confirm_cells(cells: dict, runs: dict, start, deadline, cells_meta: dict) -> dict:
    """Apply the confirmation to the notebook's per-test results (in place); returns a summary."""
    summary = {"ran": True, "notebooks": {}}
    for name, run in runs.items():
        run.wait()
        res = run.results()
        rows = cells.get(name, {})
        metas = {m["name"]: m for m in cells_meta.get(name, [])}
        again = [cid for t, row in rows.items() if t in metas
                 for cid in lowered(row, metas[t], res["tests"], sound(res))]
        attempts = 1
        if again and time.time() < deadline - 10:       # once more, alone: a loaded machine is no tamperer
            retry = start(name, only=set(again), retry=True)
            retry.wait()
            res2 = retry.results()
            attempts = 2
            for cid in again:
                if cid in res2["tests"]:
                    res["tests"][cid] = res2["tests"][cid]
            res["flags"] += res2["flags"]
        for cid, row in rows.items():
            if row["status"] == "manual" or cid not in metas:
                continue
            outcomes = part_outcomes(metas[cid], res["tests"], res["done"], res["exit"])
            before = float(row["points"] or 0)
            score_row(row, metas[cid], outcomes)
            whys = {part: w for part, (_, w) in outcomes.items()}
            why = "passed" if set(whys.values()) == {"passed"} else "; ".join(f"{p}: {w}" for p, w in whys.items())
            row["confirmed"] = why if float(row["points"]) >= before else f"failed: {why}"
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
                                      "unconfirmed": again}
    return summary


def report_points(runs: dict, cells_meta: dict, send) -> None:
    """As each notebook's confirmation run ends, send the fraction of its points each part of each test
    scored there to the grader (``{"type": "confirmation", ...}``, keyed by the confirmation's ids): if
    the worker is then killed at the wall-clock limit, the grader scores the tests from these
    (:func:`score_row`)."""
    for name, run in runs.items():
        run.wait()
        res = run.results()
        points = {}
        for m in cells_meta.get(name, []):
            if m["kind"] == "manual":
                continue
            for part, (frac, _) in part_outcomes(m, res["tests"], True).items():
                points[m["name"] + (HIDDEN_PART if part == "hidden" else "")] = frac
        send({"type": "confirmation", "notebook": name, "points": points})
