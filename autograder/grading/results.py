"""What ``grade`` writes for people: results.csv / results.json, and the feedback per student.

``results.csv`` has one row per test (points, status, reason, flags, the confirmation's
verdict, and an empty ``similarity`` that ``python -m autograder similarity`` fills); what holds for
the whole batch (the sandbox, the confirmation, the limits, the due dates) is in ``batch.json``, once,
not on every row; ``results.json`` has both, per submission, and is what ``grade --student`` merges into. Feedback is nbgrader's, with a summary table on top; the executed
notebooks (with hidden tests) are copied to ``autograded/`` for the instructor only.
"""
from __future__ import annotations

import csv
import html
import json
import shutil
from pathlib import Path

from autograder.grading.records import Job

RESULT_FIELDS = ["student", "lab", "notebook", "cell", "points", "max_points", "status",
                 "reason", "flags", "confirmed", "similarity"]


def write_results(out: Path, jobs: list[Job], meta: dict) -> list[dict]:
    rows = []
    for j in sorted(jobs, key=lambda j: (j.student, j.lab)):
        notes = j.result.get("notes", [])
        for nb, cells in j.result["cells"].items():
            for cell, r in cells.items():
                rows.append({"student": j.student, "lab": j.lab, "notebook": nb, "cell": cell,
                             "points": float(r["points"] or 0.0), "max_points": r["max_points"],
                             "status": r["status"], "reason": r["reason"],
                             "flags": "; ".join(r.get("flags", []) + notes),
                             "confirmed": r.get("confirmed", ""), "similarity": ""})
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        w.writeheader()
        w.writerows(rows)
    subs = []
    for j in sorted(jobs, key=lambda j: (j.student, j.lab)):
        cells = j.result["cells"]
        score = sum(float(r["points"] or 0) for c in cells.values() for r in c.values())
        mx = sum(r["max_points"] for c in cells.values() for r in c.values())
        subs.append({"student": j.student, "lab": j.lab, "score": score, "max_score": mx,
                     "graded_by_nbgrader": j.result.get("graded", False),
                     "failure": j.result.get("failure"), "notes": j.result.get("notes", []),
                     "seconds": round(j.seconds, 2), "submitted": j.result.get("submitted", True),
                     "timestamp": j.result.get("timestamp"), "late_penalty": j.result.get("late_penalty", {}),
                     "gpus": j.result.get("gpus"),
                     "tests": [dict(notebook=nb, cell=c, **r) for nb, cs in cells.items()
                               for c, r in cs.items()]})
    (out / "results.json").write_text(json.dumps(dict(meta, submissions=subs), indent=1))
    (out / "batch.json").write_text(json.dumps(batch_facts(meta, rows), indent=1))
    return rows


def batch_facts(meta: dict, rows: list[dict]) -> dict:
    """What holds for every row of results.csv (``batch.json``): how the batch was graded."""
    return dict(meta, sandbox=meta.get("sandbox") or "none", submissions=len({(r["student"], r["lab"]) for r in rows}),
                rows=len(rows), files={"grades": "grades.csv", "results": "results.csv", "per_submission": "results.json"})


def load_previous(out: Path) -> list[Job]:
    """The jobs recorded in an earlier OUT/results.json (for ``grade --student``)."""
    path = out / "results.json"
    if not path.is_file():
        raise SystemExit(f"--student merges into an earlier run, but {path} does not exist")
    data = json.loads(path.read_text())
    jobs = []
    for sub in data.get("submissions", []):
        cells: dict = {}
        for t in sub.get("tests", []):
            t = dict(t)
            nb, cell = t.pop("notebook"), t.pop("cell")
            cells.setdefault(nb, {})[cell] = t
        j = Job(sub["student"], sub["lab"], None, out / "_work" / "none")
        j.result = {"student": sub["student"], "lab": sub["lab"], "graded": sub.get("graded_by_nbgrader", False),
                    "failure": sub.get("failure"), "notes": sub.get("notes", []), "cells": cells,
                    "submitted": sub.get("submitted", True), "timestamp": sub.get("timestamp"),
                    "late_penalty": sub.get("late_penalty", {})}
        j.seconds = float(sub.get("seconds") or 0)
        jobs.append(j)
    return jobs


def _summary_html(j: Job) -> str:
    esc = html.escape
    notes = j.result.get("notes", [])
    parts = ['<div id="autograder-summary" style="font-family:sans-serif;margin:1em;'
             'padding:1em;border:1px solid #888">',
             f"<h2>Autograder results: {esc(j.student)} / {esc(j.lab)}</h2>"]
    if j.result.get("failure"):
        parts.append(f"<p><b>Problem:</b> {esc(j.result['failure'])}</p>")
    if notes:
        parts.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    parts.append("<table border=1 cellpadding=4><tr><th>notebook</th><th>test</th><th>points</th>"
                 "<th>status</th><th>reason</th><th>notes</th></tr>")
    for nb, cells in j.result["cells"].items():
        for c, r in cells.items():
            parts.append(f"<tr><td>{esc(nb)}</td><td>{esc(c)}</td>"
                         f"<td>{float(r['points'] or 0):g} / {r['max_points']:g}</td>"
                         f"<td>{esc(r['status'])}</td><td>{esc(r['reason'])}</td>"
                         f"<td>{esc('; '.join(r.get('flags', [])))}</td></tr>")
    parts.append("</table></div>")
    return "\n".join(parts)


def write_feedback(out: Path, j: Job) -> list[Path]:
    """OUT/feedback/<student>/<lab>/<notebook>.html (nbgrader's feedback + a summary)."""
    dest = out / "feedback" / j.student / j.lab
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    summary = _summary_html(j)
    made = []
    src = j.job_dir / "course" / "feedback" / j.student / j.lab
    for nb in j.result["cells"]:
        f = src / f"{nb}.html"
        text = None
        if j.result.get("graded") and f.is_file() and not f.is_symlink():
            text = f.read_text(errors="replace")
            i = text.find("<body")
            i = text.find(">", i) + 1 if i >= 0 else 0
            text = text[:i] + summary + text[i:]
        if text is None:
            text = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
                    f"<title>{html.escape(j.student)} {html.escape(j.lab)}</title></head>"
                    f"<body>{summary}</body></html>")
        (dest / f"{nb}.html").write_text(text)
        made.append(dest / f"{nb}.html")
    ag = j.job_dir / "course" / "autograded" / j.student / j.lab
    shutil.rmtree(out / "autograded" / j.student / j.lab, ignore_errors=True)
    if ag.is_dir():  # instructor copy (contains hidden tests): not for students
        shutil.copytree(ag, out / "autograded" / j.student / j.lab, dirs_exist_ok=True, symlinks=True)
    return made
