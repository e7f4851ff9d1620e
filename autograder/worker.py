"""Grade ONE submission in a private course directory (run as a child process).

``python -m autograder.worker SPEC.json`` — started by ``autograder.grade`` in its
own session, with a wall-clock limit; everything it starts is killed afterwards.
Writes ``result.json`` (and feedback HTML, the autograded notebook, a private
gradebook) into the job directory given in the spec.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path

from autograder.course import lab_cells, load_config, read_nb, run_converter, write_nb
from autograder.notebooks import classify, load, locate, repair, skip_demos


def autograde_config(course: Path, progress: Path, cell_timeout: int):
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, IgnorePattern,
                                        LimitOutput, SaveAutoGrades)

    from autograder.nbext import ProgressExecute, TruncateOutput

    c = load_config(root=course)
    c.Execute.timeout = int(cell_timeout)
    c.ProgressExecute.progress_file = str(progress)
    c.Autograde.autograde_preprocessors = [
        ProgressExecute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput, TruncateOutput,
        SaveAutoGrades, AssignLatePenalties, CheckCellMetadata]
    return c


def feedback_config(course: Path):
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import GetGrades

    from autograder.nbext import HideHiddenTests, TruncateOutput

    c = load_config(root=course)
    c.HTMLExporter.template_name = "feedback"
    c.GenerateFeedback.preprocessors = [HideHiddenTests, TruncateOutput, GetGrades,
                                        CSSHTMLHeaderPreprocessor]
    return c


def run(spec: dict) -> dict:
    from nbgrader.api import Gradebook
    from nbgrader.converters import Autograde, GenerateFeedback

    job = Path(spec["job_dir"])
    student, lab = spec["student"], spec["lab"]
    template = Path(spec["template"])
    course = job / "course"
    shutil.rmtree(course, ignore_errors=True)
    (course / "source").mkdir(parents=True)
    shutil.copytree(template / "source" / lab, course / "source" / lab)
    shutil.copytree(template / "release" / lab, course / "release" / lab)
    shutil.copy(template / "gradebook.db", course / "gradebook.db")
    cells_meta = lab_cells(course, lab)
    names = list(cells_meta)
    release_nbs = {n: read_nb(course / "release" / lab / f"{n}.ipynb") for n in names}

    sub_dir = Path(spec["submission_dir"])
    dest = course / "submitted" / student / lab
    dest.mkdir(parents=True)
    if (sub_dir / "timestamp.txt").is_file():
        shutil.copy(sub_dir / "timestamp.txt", dest / "timestamp.txt")
    notes: list[str] = []
    cell_flags: dict[str, dict[str, list[str]]] = {}
    unusable: dict[str, str] = {}
    for name in names:
        path, found_notes = locate(sub_dir, name, [n for n in names if n != name], release_nbs)
        notes += found_notes
        if path is None:
            unusable[name] = found_notes[0]
            continue
        try:
            nb = load(path)
        except ValueError as e:
            unusable[name] = str(e)
            notes.append(str(e))
            continue
        nb, flags, nb_notes = repair(nb, release_nbs[name])
        notes += nb_notes
        graded_ids = {m["name"] for m in cells_meta[name]}
        for gid, fl in flags.items():  # solution / markdown cells have no results row
            if gid not in graded_ids:
                notes += [f"cell {gid!r}: {f}" for f in fl]
        cell_flags[name] = flags
        write_nb(skip_demos(nb), dest / f"{name}.ipynb")

    result = {"student": student, "lab": lab, "notes": notes, "cells": {}, "graded": False,
              "failure": None}
    progress = job / "progress.jsonl"
    if len(unusable) < len(names):
        c = autograde_config(course, progress, spec["cell_timeout"])
        r = run_converter(Autograde, c, lab, student, force=True, create_student=True)
        (job / "autograde.log").write_text(r.get("log", "") + "\n" + r.get("error", ""))
        if r["success"]:
            result["graded"] = True
        else:
            result["failure"] = failure_reason(r.get("log", "") + "\n" + r.get("error", ""), progress)

    if result["graded"]:
        with Gradebook("sqlite:///" + str(course / "gradebook.db")) as gb:
            for name, cells in cells_meta.items():
                try:
                    ag = read_nb(course / "autograded" / student / lab / f"{name}.ipynb")
                    by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in ag.cells}
                except Exception:
                    by_id = {}
                rows = {}
                for meta in cells:
                    g = gb.find_grade(meta["name"], name, lab, student)
                    pts = g.auto_score if g.manual_score is None else g.manual_score
                    if name in unusable:
                        status, reason = "error", unusable[name]
                        pts = 0.0
                    elif meta["kind"] == "manual":
                        status, reason = ("manual", "needs manual grading") if pts is None else \
                            ("pass" if pts >= meta["max_score"] else "fail", "graded")
                    else:
                        status, reason = classify(by_id.get(meta["name"]), pts, meta["max_score"],
                                                  spec["cell_timeout"])
                    rows[meta["name"]] = {"points": pts, "max_points": meta["max_score"],
                                          "status": status, "reason": reason,
                                          "flags": cell_flags.get(name, {}).get(meta["name"], [])}
                result["cells"][name] = rows
            sub = gb.find_submission(lab, student)
            result["timestamp"] = sub.timestamp.isoformat() if sub.timestamp else None
        c = feedback_config(course)
        fr = run_converter(GenerateFeedback, c, lab, student, force=True)
        if not fr["success"]:
            result["notes"].append("feedback generation failed")
            (job / "feedback.log").write_text(fr.get("log", "") + "\n" + fr.get("error", ""))
    else:
        result["cells"] = fallback_cells(cells_meta, progress, unusable,
                                         result["failure"] or "", cell_flags)
    return result


def failure_reason(log: str, progress: Path) -> str:
    """One line: why nbgrader could not finish, and in which cell."""
    last = last_started(progress)
    where = f" while running cell {last!r}" if last else ""
    low = log.lower()
    if "kernel died" in low or "deadkernel" in low or "dead kernel" in low:
        return f"the kernel died (crash, os._exit or killed){where}"
    if "timeout" in low:
        return f"the kernel stopped responding after the cell timeout{where}"
    lines = [l for l in log.strip().split("\n") if l.strip()]
    return f"nbgrader autograde failed{where}: " + (lines[-1].strip()[:200] if lines else "unknown error")


def read_progress(progress: Path) -> list[dict]:
    if not progress.is_file():
        return []
    out = []
    for line in progress.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def last_started(progress: Path):
    """Label of the cell that was started last and never finished (or None)."""
    recs = read_progress(progress)
    done = {r["index"] for r in recs if r["event"] == "done"}
    started = [r for r in recs if r["event"] == "start" and r["index"] not in done]
    if not started:
        return None
    r = started[-1]
    return r.get("grade_id") or f"#{r['index'] + 1}"


def fallback_cells(cells_meta, progress: Path, unusable: dict, reason: str, cell_flags=None,
                   status_unrun: str = "error") -> dict:
    """Per-cell results when nbgrader never finished: cells that completed keep the score
    nbgrader's rules give them; the rest get 0 with ``reason``."""
    done = {r["grade_id"]: r for r in read_progress(progress)
            if r["event"] == "done" and r.get("grade_id") and "points" in r}
    out = {}
    for name, cells in cells_meta.items():
        rows = {}
        for meta in cells:
            d = done.get(meta["name"])
            flags = (cell_flags or {}).get(name, {}).get(meta["name"], [])
            if name in unusable:
                row = (0.0, "error", unusable[name])
            elif d is not None and name not in unusable:
                row = (d["points"] or 0.0, d["status"], d["reason"])
            else:  # never finished: the stuck cell or one after it
                row = (0.0, status_unrun, reason or "not run")
            rows[meta["name"]] = {"points": row[0], "max_points": meta["max_score"],
                                  "status": row[1], "reason": row[2], "flags": flags}
        out[name] = rows
    return out


PRELOAD = ["autograder.worker", "autograder.nbext", "nbgrader.converters", "nbgrader.api",
           "nbgrader.coursedir", "nbgrader.preprocessors", "nbconvert.exporters",
           "jupyter_client.manager", "nbclient"]


def child_entry(spec_path: str, env: dict, log_path: str) -> None:
    """Entry point in a process forked from the forkserver (see autograder.grade):
    a new session, the job's environment (with its kill tag), output to the job log."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        main([spec_path])
    except BaseException:
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    job = Path(spec["job_dir"])
    try:
        result = run(spec)
    except BaseException:
        (job / "worker_error.txt").write_text(traceback.format_exc())
        raise
    tmp = job / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.rename(job / "result.json")


if __name__ == "__main__":
    main()
