"""Grade ONE submission in a private course directory (run as a child process).

Started by ``autograder.grade`` in its own session, with a wall-clock limit; everything it
starts is killed afterwards. It talks to the parent only through a pipe: progress records as
cells run, then the result. Nothing a kernel can write (files in the job folder, the per-job
gradebook) decides a score: notebook points are computed here, from the kernel's replies, as
each cell finishes; confirmed points come from the confirmation run (:mod:`autograder.confirm`).

Steps: copy the template course; find, parse and repair the notebook(s); copy the files handed
in next to them (flagged); read the flags from the source; start the confirmation run; run
``nbgrader autograde`` with the kernel in the sandbox; combine notebook and confirmation
points; write them into the per-job gradebook (so nbgrader's feedback shows them); generate
the feedback.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from autograder.confirm.handed_in import shadows
from autograder.course.cells import grade_id, nbg, read_nb, skip_demos, write_nb
from autograder.course.config import load_config
from autograder.course.template import lab_cells, run_converter
from autograder.notebooks import load, locate, repair
from autograder.records import failure_reason, fallback_cells, notebook_cells
from autograder.retry import RETRY_TIMEOUT_SCALE, overrides, scaled
from autograder.sandbox.kernel import KernelJob, kernel_manager
from minidist.protocol import HIDDEN_CASES_ENV, HIDDEN_IN_CONFIRMATION

MAX_EXTRA_BYTES = 20 << 20          # files handed in next to the notebook: at most this much is copied
MAX_EXTRA_FILES = 200


def autograde_config(course: Path, cell_timeout: int, kernel: KernelJob, sink):
    """nbgrader's configuration for one run of ``autograde``: this job's kernels (:class:`KernelJob`, in
    the sandbox where there is one) and its progress records to ``sink``."""
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, IgnorePattern,
                                        LimitOutput, SaveAutoGrades)

    from autograder.nbext import ProgressExecute, TruncateOutput, with_sink

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

    from autograder.nbext import TruncateOutput, hiding

    c = load_config(root=course)
    c.HTMLExporter.template_name = "feedback"
    c.GenerateFeedback.preprocessors = [hiding(release_tests), TruncateOutput, GetGrades,
                                        CSSHTMLHeaderPreprocessor]
    return c


def copy_extra_files(sub_dir: Path, dest: Path, notebooks: set[Path]) -> list[str]:
    """Files handed in next to the notebook(s): copied into the kernel's working folder (regular
    files only, no links, within size limits) and listed, so that the instructor sees them."""
    copied, skipped, total = [], [], 0
    for root, dirs, files in os.walk(sub_dir, followlinks=False):
        dirs[:] = [d for d in dirs if d not in (".ipynb_checkpoints", "__pycache__") and
                   not os.path.islink(os.path.join(root, d))]
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(sub_dir)
            if path in notebooks or name == "timestamp.txt" or name.endswith(".ipynb"):
                continue
            if path.is_symlink() or not path.is_file():
                skipped.append(f"{rel} (a link)")
                continue
            top = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or name.endswith(".py") else None
            if top and shadows(top):
                skipped.append(f"{rel} (named like the standard or installed module {top!r}: refused)")
                continue
            size = path.stat().st_size
            if total + size > MAX_EXTRA_BYTES or len(copied) >= MAX_EXTRA_FILES:
                skipped.append(f"{rel} (over the size limit)")
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / rel)
            copied.append(str(rel))
            total += size
    notes = []
    if copied:
        notes.append("files handed in next to the notebook (importable by the graded code, in the kernel "
                     "and in the confirmation, after minidist): " + ", ".join(copied[:20]) + (" ..." if len(copied) > 20 else ""))
    if skipped:
        notes.append("files handed in but not copied: " + ", ".join(skipped[:10]))
    return notes


def run(spec: dict, send=lambda msg: None) -> dict:
    from nbgrader.api import Gradebook
    from nbgrader.converters import Autograde, GenerateFeedback

    from autograder import gradebook
    from autograder.confirm import handed_in
    from autograder.confirm.points import confirm_cells, report_points
    from autograder.confirm.start import Confirmation, plan
    from autograder.flags import notebook_flags
    from autograder.sandbox.backend import Backend, give, limits
    from autograder.sandbox.home import inner_env, prepare_home

    t_start = time.time()
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
    source_nbs = {n: read_nb(course / "source" / lab / f"{n}.ipynb") for n in names}

    sub_dir = Path(spec["submission_dir"])
    dest = course / "submitted" / student / lab
    dest.mkdir(parents=True)
    if (sub_dir / "timestamp.txt").is_file():
        shutil.copy(sub_dir / "timestamp.txt", dest / "timestamp.txt")
    notes: list[str] = []
    flags_static: list[str] = []
    cell_flags: dict[str, dict[str, list[str]]] = {}
    unusable: dict[str, str] = {}
    graded_nbs: dict[str, object] = {}
    used: set[Path] = set()
    for name in names:
        path, found_notes = locate(sub_dir, name, [n for n in names if n != name], release_nbs)
        notes += found_notes
        if path is None:
            unusable[name] = found_notes[0]
            continue
        used.add(path)
        try:
            nb = load(path)
        except ValueError as e:
            unusable[name] = str(e)
            notes.append(str(e))
            continue
        flags_static += notebook_flags(nb)
        nb, flags, nb_notes = repair(nb, release_nbs[name], source_nbs[name])
        notes += nb_notes
        graded_ids = {m["name"] for m in cells_meta[name]}
        for gid, fl in flags.items():  # solution / markdown cells have no results row
            if gid not in graded_ids:
                notes += [f"cell {gid!r}: {f}" for f in fl]
        cell_flags[name] = flags
        graded_nbs[name] = nb
        write_nb(skip_demos(nb), dest / f"{name}.ipynb")
    notes += copy_extra_files(sub_dir, dest, used)
    if flags_static:
        notes.append("suspicious code (for the instructor; no score change): " + "; ".join(flags_static[:12])
                     + (f"; ... ({len(flags_static)} in all)" if len(flags_static) > 12 else ""))

    # --- the sandbox's private home, and the confirmation runs (they need nothing from nbgrader's)
    backend = Backend(**spec["sandbox"]) if spec.get("sandbox") else None
    # the job's uid and limits: in the sandbox, or alone where none works (never root); none at all only
    # when the sandbox is turned off on purpose (autograder/core.py: prepare_batch)
    drop = spec.get("drop", True)
    uid = spec.get("uid") if drop else None
    # what the sandboxes of this job see of the grader's files: in the batch's area, the job's uid's
    box = Path(tempfile.mkdtemp(prefix="job-", dir=spec.get("area") or None))
    home = box / "home"
    pristine = Path(spec["pristine"])
    skeleton = Path(spec["skeleton"]) if spec.get("skeleton") else None
    prepare_home(home, skeleton)
    startup = home / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)    # the kernel's handed-in files: for the student's imports only
    shutil.copyfile(handed_in.__file__, startup / "00-handed-in.py")
    kernel_cwd = shutil.copytree(dest, box / "kernel-cwd")     # what the student handed in, no hidden tests
    give(box, uid)
    limit = limits(cpu_seconds=2 * float(spec.get("wall", 600))) if drop else None
    confirming = spec.get("confirm", True)
    # a confirmed batch's kernels have no hidden cases: their hidden=True calls are the confirmation's
    kernel = KernelJob(backend, str(home), str(pristine), spec["tag_var"], str(kernel_cwd), uid, spec.get("tools"),
                       limit, env={HIDDEN_CASES_ENV: HIDDEN_IN_CONFIRMATION} if confirming else {})
    deadline = t_start + float(spec.get("wall", 600)) - 5
    conf_env = inner_env(os.environ, str(home / "confirm"), str(pristine), spec["tag_var"])

    def start_confirmation(name, only=None, retry=False):
        wd = box / "confirm" / f"{name}-{2 if retry else 1}"
        chome = prepare_home(wd, skeleton)
        copy_extra_files(sub_dir, wd, used)        # a helper module works in both runs, or in neither
        give(wd, uid)
        env = dict(conf_env, HOME=str(chome), IPYTHONDIR=str(chome / ".ipython"), MPLCONFIGDIR=str(chome / ".mpl"),
                   JUPYTER_RUNTIME_DIR=str(chome / ".runtime"))
        scale = RETRY_TIMEOUT_SCALE if retry else 1          # what timed out under load gets more time
        return Confirmation(plan(source_nbs[name], graded_nbs[name]), pristine=pristine, workdir=wd, sandbox=backend,
                            env=scaled(env, scale), box={"uid": uid, "tools": spec.get("tools"), "limit": limit},
                            timeout=max(10.0, deadline - time.time()), cell_timeout=spec["cell_timeout"] * scale,
                            log=job / f"confirm-{wd.name}.log", only=only)

    runs = {n: start_confirmation(n) for n in graded_nbs} if confirming else {}
    if runs:      # the grader hears the confirmed points even if this worker never finishes
        threading.Thread(target=report_points, args=(runs, cells_meta, send), daemon=True).start()

    # --- nbgrader autograde, the kernel in the sandbox; scores from the progress records
    records: list[dict] = []

    def sink(rec):
        records.append(rec)
        send({"type": "progress", **rec})
    result = {"student": student, "lab": lab, "notes": notes, "cells": {}, "graded": False,
              "failure": None}
    if len(unusable) < len(names):
        c = autograde_config(course, spec["cell_timeout"], kernel, sink)
        r = run_converter(Autograde, c, lab, student, force=True, create_student=True)
        (job / "autograde.log").write_text(r.get("log", "") + "\n" + r.get("error", ""))
        if r["success"]:
            result["graded"] = True
        else:
            result["failure"] = failure_reason(r.get("log", "") + "\n" + r.get("error", ""), records,
                                               _sandbox_errors(job / "worker.log"))
    if result["graded"]:
        result["cells"] = notebook_cells(course, lab, student, cells_meta, unusable, records, cell_flags,
                                         spec["cell_timeout"])
        retry_timeouts(result["cells"], course, lab, student, cells_meta, unusable, cell_flags, spec, deadline, kernel)
    else:
        result["cells"] = fallback_cells(cells_meta, records, unusable, result["failure"] or "", cell_flags)

    # --- confirmation: combine, retry what was not confirmed once, alone
    if confirming:
        result["confirmation"] = confirm_cells(result["cells"], runs, start_confirmation, deadline, cells_meta)
    else:
        result["confirmation"] = {"ran": False}

    if result["graded"]:
        with Gradebook("sqlite:///" + str(course / "gradebook.db")) as gb:
            for name, rows in result["cells"].items():
                for cell, row in rows.items():
                    if row["status"] == "manual":
                        continue
                    g = gb.find_grade(cell, name, lab, student)
                    g.auto_score = float(row["points"] or 0.0)
                    g.manual_score = None
                    g.needs_manual_grade = False
            gb.db.commit()
            sub = gb.find_submission(lab, student)
            result["timestamp"] = sub.timestamp.isoformat() if sub.timestamp else None
            result["late_penalty"] = gradebook.late_penalties(gb, course, lab, student, sub, list(result["cells"]))
            if result["late_penalty"]:
                result["notes"].append(f"submitted {sub.total_seconds_late / 3600:.1f} h late: penalty "
                                       + ", ".join(f"{v:g}" for v in result["late_penalty"].values()))
        release_tests = {grade_id(c): c.source for nb in release_nbs.values() for c in nb.cells
                         if grade_id(c) and nbg(c).get("grade") and not nbg(c).get("solution")}
        c = feedback_config(course, release_tests)
        fr = run_converter(GenerateFeedback, c, lab, student, force=True)
        if not fr["success"]:
            result["notes"].append("feedback generation failed")
            (job / "feedback.log").write_text(fr.get("log", "") + "\n" + fr.get("error", ""))
    shutil.rmtree(box, ignore_errors=True)
    return result


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
    """A test that timed out in the notebook run gets the second chance (:mod:`autograder.retry`): the
    notebook runs once more, its kernel's launch timeouts and the cell timeout x ``RETRY_TIMEOUT_SCALE``
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


PRELOAD = ["autograder.worker", "autograder.nbext", "autograder.sandbox.kernel", "autograder.confirm.start",
           "autograder.confirm.points", "autograder.gradebook",
           "autograder.flags", "nbgrader.converters", "nbgrader.api", "nbgrader.coursedir",
           "nbgrader.preprocessors", "nbconvert.exporters", "jupyter_client.manager", "nbclient"]


def child_entry(spec: dict, env: dict, log_path: str, conn) -> None:
    """Entry point in a process forked from the forkserver (see autograder.grade): a new
    session, the job's environment (with its kill tag), output to the job log, and ``conn``,
    the write end of the pipe to the parent: progress records, then the result, as JSON."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

    lock = threading.Lock()           # progress (main thread) and confirmation reports share the pipe

    def send(msg):
        try:
            data = json.dumps(msg, default=str).encode()
            with lock:
                conn.send_bytes(data)
        except (OSError, ValueError):
            pass
    code = 0
    try:
        result = run(spec, send)
        send({"type": "result", "result": result})
    except BaseException:
        send({"type": "error", "error": traceback.format_exc()[-4000:]})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.close()
    except OSError:
        pass
    os._exit(code)
