"""``python -m autograder grade``: grade a class, each submission in isolation, in parallel.

Design (nbgrader has no parallel autograde, its issue #174):
1. one *template* course is built once: ``nbgrader generate_assignment`` for every lab
   graded, giving source/, release/ and a gradebook;
2. each submission <student>/<lab>/ is graded by a child process
   (``autograder.worker``) in its own course directory with its own copy of the
   gradebook, in its own session, under a wall-clock limit; afterwards every process
   it started is killed (``autograder.procs``);
3. the scores are merged into one nbgrader gradebook (``OUT/gradebook.db``) through
   nbgrader's Gradebook API, and ``grades.csv`` is written by nbgrader's CSV export.
"""
from __future__ import annotations

import csv
import html
import json
import os
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from autograder import REPO, SUBMISSION_TIMEOUT
from autograder.course import (all_labs, build_course, cell_timeout, kernel_argv, lab_cells,
                               solutions_dir)
from autograder import worker
from autograder.procs import TAG_VAR, kill_job
from autograder.worker import fallback_cells, last_started

_CTX = None
_CTX_LOCK = threading.Lock()


def _ctx():
    """A forkserver that has imported nbgrader once (importing it takes seconds):
    each submission is a fresh fork of it, in its own session."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            import multiprocessing as mp
            # the forkserver starts with our sys.path: make sure this checkout's
            # autograder package is found first (an old editable install may map it
            # to a namespace package)
            if str(REPO) not in sys.path:
                sys.path.insert(0, str(REPO))
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(worker.PRELOAD)
            _CTX = ctx
        return _CTX

RESULT_FIELDS = ["student", "lab", "notebook", "cell", "points", "max_points", "status",
                 "reason", "flags"]


@dataclass
class Job:
    student: str
    lab: str
    submission_dir: Path | None
    job_dir: Path
    result: dict = field(default_factory=dict)
    seconds: float = 0.0


class Progress:
    """A dependency-free progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        # sys.stderr at call time, not at import time (pytest swaps and closes it per test)
        stream = sys.stderr if stream is None else stream
        self.total, self.done, self.enabled, self.stream = total, 0, enabled, stream
        self.t0 = time.time()
        self.lock = threading.Lock()
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._draw("")

    def _draw(self, label: str):
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"grading [{bar}] {self.done}/{self.total} "
                f"{time.time() - self.t0:5.0f}s {label}")
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step(self, label: str):
        with self.lock:
            self.done += 1
            self._draw(label)

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def discover(submissions: Path, labs: list[str] | None) -> tuple[list[tuple[str, str, Path | None]], list[str], list[str]]:
    """[(student, lab, dir or None)], the labs graded, and ignored entries."""
    known = all_labs()
    ignored = []
    students = sorted(p for p in submissions.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")))
    if labs:
        unknown = [l for l in labs if l not in known]
        if unknown:
            raise SystemExit(f"unknown lab(s) {unknown}; labs under {solutions_dir()}: {known}")
        graded = list(labs)
    else:
        graded = sorted({d.name for s in students for d in s.iterdir() if d.is_dir()} & set(known))
    for s in students:
        for d in s.iterdir():
            if d.is_dir() and d.name not in graded and not d.name.startswith("."):
                ignored.append(f"{s.name}/{d.name}")
    entries = []
    for s in students:
        for lab in graded:
            d = s / lab
            entries.append((s.name, lab, d if d.is_dir() else None))
    return entries, graded, ignored


def _warm_forkserver():
    try:
        from multiprocessing import forkserver
        _ctx()
        forkserver.ensure_running()
    except Exception:
        pass


def run_job(job: Job, template: Path, ctimeout: int, wall: float, env: dict) -> Job:
    t0 = time.time()
    job.job_dir.mkdir(parents=True, exist_ok=True)
    cells_meta = lab_cells(template, job.lab)
    if job.submission_dir is None:
        reason = "no submission for this lab"
        job.result = {"student": job.student, "lab": job.lab, "graded": False, "notes": [reason],
                      "failure": reason, "submitted": False,
                      "cells": fallback_cells(cells_meta, job.job_dir / "none", {n: reason for n in cells_meta}, reason)}
        return job
    spec = {"student": job.student, "lab": job.lab, "submission_dir": str(job.submission_dir),
            "job_dir": str(job.job_dir), "template": str(template), "cell_timeout": ctimeout}
    spec_path = job.job_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    tag = uuid.uuid4().hex
    env = dict(env, **{TAG_VAR: tag})
    proc = _ctx().Process(target=worker.child_entry,
                          args=(str(spec_path), env, str(job.job_dir / "worker.log")),
                          name=f"grade-{job.student}-{job.lab}", daemon=False)
    proc.start()
    proc.join(timeout=wall)
    timed_out = proc.exitcode is None
    # while the worker lives its pid names its group/session/descendants; once it has
    # exited (and been reaped) the pid may be reused, so only the tag is trusted
    kill_job(tag, proc.pid if timed_out else None)
    proc.join()
    res_path = job.job_dir / "result.json"
    if res_path.is_file() and not timed_out:
        job.result = json.loads(res_path.read_text())
    else:
        progress = job.job_dir / "progress.jsonl"
        stuck = last_started(progress)
        if timed_out:
            reason = f"submission exceeded the {wall:g} s wall-clock limit" + \
                (f" while running cell {stuck!r}" if stuck else "") + "; killed"
        else:
            err = job.job_dir / "worker_error.txt"
            tail = err.read_text().strip().split("\n")[-1][:200] if err.is_file() else \
                f"worker exited with code {proc.exitcode}"
            reason = f"grading failed: {tail}"
        job.result = {"student": job.student, "lab": job.lab, "graded": False, "notes": [reason],
                      "failure": reason,
                      "cells": fallback_cells(cells_meta, progress, {}, reason,
                                              status_unrun="timeout" if timed_out else "error")}
    job.result.setdefault("submitted", True)
    job.seconds = time.time() - t0
    return job


def merge_gradebook(template: Path, out: Path, jobs: list[Job]) -> Path:
    """One nbgrader gradebook for the whole class, then nbgrader's CSV export."""
    from nbgrader.api import Gradebook

    db = out / "gradebook.db"
    if db.exists():
        db.unlink()
    shutil.copy(template / "gradebook.db", db)
    url = "sqlite:///" + str(db)
    import warnings
    with warnings.catch_warnings(), Gradebook(url) as gb:
        warnings.simplefilter("ignore")  # SQLAlchemy autoflush notes from nbgrader's API
        for s in sorted({j.student for j in jobs}):
            gb.update_or_create_student(s)
        for j in jobs:
            if not j.result.get("submitted", True):
                continue
            kw = {}
            if j.result.get("timestamp"):
                from nbgrader.utils import parse_utc
                kw["timestamp"] = parse_utc(j.result["timestamp"])
            gb.update_or_create_submission(j.lab, j.student, **kw)
            for nb, rows in j.result["cells"].items():
                for cell, row in rows.items():
                    g = gb.find_grade(cell, nb, j.lab, j.student)
                    if row["status"] == "manual":
                        continue
                    g.auto_score = float(row["points"] or 0.0)
                    g.needs_manual_grade = False
            gb.db.commit()
    return db


def export_csv(db: Path, dest: Path) -> None:
    from nbgrader.api import Gradebook
    from nbgrader.plugins.export import CsvExportPlugin

    with Gradebook("sqlite:///" + str(db)) as gb:
        plugin = CsvExportPlugin(to=str(dest))
        plugin.export(gb)


def write_results(out: Path, jobs: list[Job], meta: dict) -> list[dict]:
    rows = []
    for j in sorted(jobs, key=lambda j: (j.student, j.lab)):
        notes = j.result.get("notes", [])
        for nb, cells in j.result["cells"].items():
            for cell, r in cells.items():
                rows.append({"student": j.student, "lab": j.lab, "notebook": nb, "cell": cell,
                             "points": float(r["points"] or 0.0), "max_points": r["max_points"],
                             "status": r["status"], "reason": r["reason"],
                             "flags": "; ".join(r.get("flags", []) + notes)})
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
                     "seconds": round(j.seconds, 2),
                     "tests": [dict(notebook=nb, cell=c, **r) for nb, cs in cells.items()
                               for c, r in cs.items()]})
    (out / "results.json").write_text(json.dumps(dict(meta, submissions=subs), indent=1))
    return rows


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
    dest.mkdir(parents=True, exist_ok=True)
    summary = _summary_html(j)
    made = []
    src = j.job_dir / "course" / "feedback" / j.student / j.lab
    for nb in j.result["cells"]:
        f = src / f"{nb}.html"
        if j.result.get("graded") and f.is_file():
            text = f.read_text()
            i = text.find("<body")
            i = text.find(">", i) + 1 if i >= 0 else 0
            text = text[:i] + summary + text[i:]
        else:
            text = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
                    f"<title>{html.escape(j.student)} {html.escape(j.lab)}</title></head>"
                    f"<body>{summary}</body></html>")
        (dest / f"{nb}.html").write_text(text)
        made.append(dest / f"{nb}.html")
    ag = j.job_dir / "course" / "autograded" / j.student / j.lab
    if ag.is_dir():  # instructor copy (contains hidden tests): not for students
        shutil.copytree(ag, out / "autograded" / j.student / j.lab, dirs_exist_ok=True)
    return made


def grade(submissions, out, jobs: int = 1, labs: list[str] | None = None,
          cell_timeout_s: int | None = None, wall_s: float | None = None,
          progress: bool = True, keep_work: bool = False) -> dict:
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if not submissions.is_dir():
        raise SystemExit(f"no such directory: {submissions}")
    kernel_argv()
    ctimeout = int(cell_timeout_s or cell_timeout())
    wall = float(wall_s or SUBMISSION_TIMEOUT)
    entries, graded, ignored = discover(submissions, labs)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "_work"
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("feedback", "autograded"):
        shutil.rmtree(out / sub, ignore_errors=True)
    t0 = time.time()
    threading.Thread(target=_warm_forkserver, daemon=True).start()
    template = build_course(graded, work / "template") if graded else None
    cpus = os.cpu_count() or 1
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, jobs)))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("JPY_PARENT_PID", None)
    todo = [Job(s, lab, d, work / "jobs" / f"{s}__{lab}") for s, lab, d in entries]
    bar = Progress(len(todo), enabled=progress)
    done: list[Job] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        futs = [ex.submit(run_job, j, template, ctimeout, wall, env) for j in todo]
        for f in as_completed(futs):
            j = f.result()
            done.append(j)
            bar.step(f"{j.student}/{j.lab}")
    bar.close()
    meta = {"labs": graded, "jobs": jobs, "cell_timeout_s": ctimeout, "wall_clock_limit_s": wall,
            "ignored": ignored, "seconds": None}
    if template is not None:
        db = merge_gradebook(template, out, done)
        export_csv(db, out / "grades.csv")
    for j in done:
        write_feedback(out, j)
    meta["seconds"] = round(time.time() - t0, 2)
    rows = write_results(out, done, meta)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return {"jobs": done, "rows": rows, "meta": meta, "out": out}
