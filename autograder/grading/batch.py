"""The one grading core: every submission, whoever grades it, goes through :func:`grade_submission`.

``python -m autograder grade`` (and so ``selftest`` and ``bench``, which call it) grades a class as
many calls of :func:`grade_submission` in one :class:`Batch`; Gradescope's ``run_autograder`` and
PrairieLearn's entry point (:mod:`autograder.handout.platforms`) grade one submission with
:func:`grade_one`, which is one batch of one call. So a fix of grading lands everywhere.

A batch is what is made once for any number of submissions (``grade``'s step 1): the pristine copy
of minidist the kernels and the confirmation import, the sandbox's probe (or why there is none), the
template course (``nbgrader generate_assignment`` of every lab graded, with its due dates), and the
workers' environment. A submission is graded by a worker under supervision
(:func:`autograder.grading.supervise.run_job`: the locked cells restored, the hidden tests, the
confirmation and its judge, the sandbox, the wall-clock limit, every process killed afterwards);
what comes back is checked (:mod:`autograder.grading.records`) and is the per-test result, ``job.result``.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from autograder import REPO
from autograder.course.config import cell_timeout, due_dates
from autograder.course.kernel import kernel_argv
from autograder.course.labs import solutions_dir
from autograder.course.template import build_course, lab_cells
from autograder.grading.gradebook import set_due_dates
from autograder.grading.records import Job, fallback_cells
from autograder.grading.supervise import run_job, warm_forkserver


#: wall-clock limit (s) for one submission (kernel start, all cells, feedback)
SUBMISSION_TIMEOUT = 600

@dataclass
class Batch:
    """What every submission of one batch shares (:func:`open_batch`)."""
    work: Path
    info: dict                        # prepare_batch's: pristine, skeleton, confirm, sandbox, area, tools
    template: Path | None             # the template course (None: no lab graded)
    env: dict                         # the workers' environment
    cell_timeout: int
    wall: float
    dues: dict = field(default_factory=dict)

    @property
    def sandbox(self) -> str:
        """Which sandbox the batch uses, or ``none: <why>`` (results' ``sandbox`` column)."""
        return str(self.info["sandbox_text"]) if self.info["sandbox"] else f"none: {self.info['sandbox_text']}"


def prepare_batch(work: Path, confirm: bool, sandbox: bool | None, out: Path, kernel: str) -> dict:
    """Once per batch: the pristine minidist, the sandbox's backend (or why there is none), and
    a home whose matplotlib font cache is built."""
    from autograder.confirm.start import copy_pristine
    from autograder.sandbox import backend as sb
    from autograder.sandbox.home import build_skeleton
    from autograder.sandbox.probe import JobsCannotReach, probe, reach_unsandboxed, turned_off
    area = sb.make_area()            # what the jobs' unprivileged uids may reach, whatever is above `out`
    pristine = copy_pristine(area / "pristine", hidden=not confirm)    # confirmed: hidden cases never in a file
    tools = sb.install_tools(area)
    skeleton = build_skeleton(work / "skeleton")
    # turned off on purpose (--no-sandbox, MINIDIST_SANDBOX=off: for measurements), the jobs keep the
    # grader's uid; missing (a container without user namespaces), a root grader's jobs still run as
    # their own unprivileged uid, the drop step alone (autograder/sandbox/backend.py: command)
    drop = sandbox is not False and not turned_off()
    if sandbox is False:
        backend, what = None, "sandbox turned off (--no-sandbox)"
    else:
        try:
            backend, what = probe(hidden=[str(REPO / "solutions"), str(REPO / "autograder"), str(out),
                                             str(solutions_dir())], area=area,
                                     pristine=str(pristine), programs=[kernel])
            if backend is None and drop:
                reach_unsandboxed(area, str(pristine), [kernel])
        except JobsCannotReach as err:      # before the first job: nothing graded, nothing written
            shutil.rmtree(area, ignore_errors=True)
            raise SystemExit(str(err)) from None
        if backend is None and sandbox is True:
            shutil.rmtree(area, ignore_errors=True)
            raise SystemExit(f"--sandbox: {what}")
    return {"pristine": str(pristine), "skeleton": str(skeleton), "confirm": bool(confirm),
            "sandbox": {"name": backend.name, "exe": backend.exe} if backend else None,
            "drop": bool(backend is not None or drop), "sandbox_text": what, "area": str(area), "tools": tools}


def open_batch(labs: list[str], work: Path, out: Path, *, jobs: int = 1, confirm: bool = True,
               sandbox: bool | None = None, cell_timeout_s: int | None = None, wall_s: float | None = None,
               due: dict[str, str] | None = None, stream=None) -> Batch:
    """Step 1 of grading, for ``labs``: ``work`` holds the batch's files (the template course), ``out``
    is hidden from the sandbox too; ``due``: {lab or "*": date} over the course configuration's.
    Close it with :func:`close_batch`."""
    stream = stream if stream is not None else sys.stderr
    kernel = kernel_argv()[0]
    kernel = shutil.which(kernel) or kernel        # the kernel's interpreter: a job must reach it too
    threading.Thread(target=warm_forkserver, daemon=True).start()
    info = prepare_batch(work, confirm, sandbox, out, kernel)
    if info["sandbox"] is None:
        who = ("as each job's own unprivileged uid, in the machine's namespaces" if info["drop"] and os.geteuid() == 0
               else "with the grading user's access")
        print(f"autograder: {info['sandbox_text']}: kernels run {who} (see docs/INTEGRITY.md, Not guarded)",
              file=stream)
    dates = merged_due_dates(labs, due)
    template = build_course(labs, work / "template") if labs else None
    dues = set_due_dates(template, {l: d for l, d in dates.items() if l in labs and d}) if template else {}
    cpus = os.cpu_count() or 1
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, jobs)))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("JPY_PARENT_PID", None)
    return Batch(work=work, info=info, template=template, env=env, cell_timeout=int(cell_timeout_s or cell_timeout()),
                 wall=float(wall_s or SUBMISSION_TIMEOUT), dues=dues)


def merged_due_dates(labs: list[str], due: dict[str, str] | None) -> dict[str, str]:
    """The course configuration's due dates, ``due`` over them (``"*"``: every lab of ``labs``)."""
    dates = dict(due_dates())
    for lab, date in (due or {}).items():
        if lab == "*":
            dates.update({l: date for l in labs})
        else:
            dates[lab] = date
    return dates


def close_batch(batch: Batch) -> None:
    """The jobs' area (the pristine minidist, the tools) goes; ``work`` is the caller's."""
    shutil.rmtree(batch.info["area"], ignore_errors=True)


def grade_submission(batch: Batch, job: Job, env: dict | None = None, stop: threading.Event | None = None) -> Job:
    """Grade one submission (``job.submission_dir``, a folder holding the lab's notebook(s) and
    whatever else was handed in): ``job.result`` is its checked per-test result,
    ``{"cells": {notebook: {test: {points, max_points, status, reason, flags, confirmed}}}, "notes",
    "failure", "graded", ...}``. Never raises for the submission's sake: a grading error costs this
    submission, with the reason, never the batch."""
    try:
        return run_job(job, batch.template, batch.cell_timeout, batch.wall, batch.env if env is None else env,
                       batch.info, stop)
    except Exception as err:          # one submission, never the batch
        reason = f"grading failed: {type(err).__name__}: {str(err)[:200]}"
        job.result = {"student": job.student, "lab": job.lab, "graded": False, "notes": [reason],
                      "failure": reason, "submitted": True, "grader_failed": True,
                      "cells": fallback_cells(lab_cells(batch.template, job.lab), [], {}, reason)}
        return job


def grade_one(submission_dir: Path, lab: str, work: Path, *, student: str = "student", confirm: bool = True,
              sandbox: bool | None = None, cell_timeout_s: int | None = None, wall_s: float | None = None,
              hide: Path | None = None, stream=None) -> tuple[Job, Batch]:
    """One submission of ``lab`` graded in a batch of its own (what a platform's grader runs once per
    submission). ``work``: an empty folder for the batch's files (the caller removes it); ``hide``: a
    folder the sandbox must not show either (the platform's results folder)."""
    work = Path(work)
    batch = open_batch([lab], work, Path(hide or work), confirm=confirm, sandbox=sandbox,
                       cell_timeout_s=cell_timeout_s, wall_s=wall_s, stream=stream)
    try:
        job = grade_submission(batch, Job(student, lab, Path(submission_dir), work / "jobs" / f"{student}__{lab}"))
    finally:
        close_batch(batch)
    return job, batch
