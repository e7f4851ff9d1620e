"""One submission's worker, supervised: started, listened to, and cleaned up after.

The worker (:mod:`autograder.grading.worker`) is a fork of a forkserver that imported nbgrader once,
in its own session, with a tag in its environment that every process it starts inherits
(:mod:`autograder.sandbox.procs`). The supervisor reads its pipe under the wall-clock limit, keeps the
records that check out (:mod:`autograder.grading.records`), then kills everything the job started,
whatever happened: a result, a crash, the limit, or the grader itself being stopped.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path

from autograder import REPO
from autograder.course.template import lab_cells
from autograder.grading.records import (Job, checked_confirmation, checked_result, confirmed_only, fallback_cells,
                                        last_started, valid_record)
from autograder.grading.worker import process
from autograder.sandbox.backend import job_uid
from autograder.sandbox.procs import TAG_VAR, kill_job

MAX_RECORD_BYTES = 50 << 20
INTERRUPTED = "grading interrupted (the grader was stopped)"

_CTX = None
_CTX_LOCK = threading.Lock()


def _ctx():
    """A forkserver that has imported nbgrader once (importing it takes seconds):
    each submission is a fresh fork of it, in its own session."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            import multiprocessing as mp
            # the forkserver starts with our sys.path: this checkout's autograder must come
            # first (an old editable install may map it to a namespace package)
            if str(REPO) not in sys.path:
                sys.path.insert(0, str(REPO))
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(process.PRELOAD)
            _CTX = ctx
        return _CTX


def warm_forkserver():
    """Start the forkserver early (in a thread), while the batch is being prepared."""
    try:
        from multiprocessing import forkserver
        _ctx()
        forkserver.ensure_running()
    except Exception:
        pass


def _listen(recv, proc, deadline: float, stop: threading.Event):
    """Read the worker's records until it ends, the deadline passes or ``stop`` is set."""
    records, result, error, unreadable, confirmed = [], None, None, 0, {}
    timed_out = False
    while not stop.is_set():
        left = deadline - time.time()
        if left <= 0:
            timed_out = proc.exitcode is None
            break
        try:
            if not recv.poll(min(left, 0.5)):
                if proc.exitcode is not None and not recv.poll(0.2):
                    break
                continue
            raw = recv.recv_bytes(MAX_RECORD_BYTES)
        except (EOFError, OSError):
            break
        except Exception:            # an oversized or broken message: this job's problem only
            unreadable += 1
            continue
        try:
            msg = json.loads(raw)
        except ValueError:
            unreadable += 1
            continue
        if not isinstance(msg, dict):
            unreadable += 1
        elif msg.get("type") == "progress" and valid_record(msg):
            records.append(msg)
        elif msg.get("type") == "confirmation" and checked_confirmation(msg):
            nb, points = checked_confirmation(msg)
            confirmed[nb] = points
        elif msg.get("type") == "result":
            result = msg.get("result")
        elif msg.get("type") == "error":
            error = str(msg.get("error", ""))
        else:
            unreadable += 1
    return records, result, error, unreadable, confirmed, timed_out


def run_job(job: Job, template: Path, ctimeout: int, wall: float, env: dict, batch: dict,
            stop: threading.Event | None = None) -> Job:
    """Grade one submission in a worker; ``job.result`` is what the grader may trust of it."""
    t0 = time.time()
    stop = stop or threading.Event()
    job.job_dir.mkdir(parents=True, exist_ok=True)
    cells_meta = lab_cells(template, job.lab)
    if job.submission_dir is None or stop.is_set():
        reason = "no submission for this lab" if job.submission_dir is None else INTERRUPTED
        job.result = {"student": job.student, "lab": job.lab, "graded": False, "notes": [reason],
                      "failure": reason, "submitted": job.submission_dir is not None,
                      "cells": fallback_cells(cells_meta, [], {n: reason for n in cells_meta}, reason)}
        return job
    tag = uuid.uuid4().hex
    spec = {"student": job.student, "lab": job.lab, "submission_dir": str(job.submission_dir),
            "job_dir": str(job.job_dir), "template": str(template), "cell_timeout": ctimeout, "wall": wall,
            "tag_var": TAG_VAR, "uid": job_uid(tag), **batch}
    ctx = _ctx()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=process.child_entry,
                       args=(spec, dict(env, **{TAG_VAR: tag}), str(job.job_dir / "worker.log"), send),
                       name=f"grade-{job.student}-{job.lab}", daemon=False)
    proc.start()
    send.close()
    records, result, error, unreadable, confirmed, timed_out = _listen(recv, proc, t0 + wall, stop)
    interrupted = stop.is_set()
    # while the worker lives its pid names its group/session/descendants; once it has
    # exited (and been reaped) the pid may be reused, so only the tag is trusted
    if proc.exitcode is None:
        proc.join(timeout=2 if not (timed_out or interrupted) else 0)
        timed_out = timed_out or (proc.exitcode is None and not interrupted)
    kill_job(tag, proc.pid if proc.exitcode is None else None)
    proc.join()
    recv.close()
    problem = None
    if result is not None and not timed_out:
        try:
            job.result = checked_result(result, job, cells_meta)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            problem = f"grading record unreadable ({type(err).__name__}: {str(err)[:120]})"
    if job.result == {} or problem:
        stuck = last_started(records)
        if interrupted:
            reason = INTERRUPTED
        elif timed_out:
            reason = f"submission exceeded the {wall:g} s wall-clock limit" + \
                (f" while running cell {stuck!r}" if stuck else "") + "; killed"
        elif problem:
            reason = problem
        else:
            tail = error.strip().split("\n")[-1][:200] if error else f"worker exited with code {proc.exitcode}"
            reason = f"grading failed: {tail}"
        job.result = {"student": job.student, "lab": job.lab, "graded": False, "notes": [reason],
                      "failure": reason, "grader_failed": not timed_out,     # a timeout is the submission's
                      "cells": fallback_cells(cells_meta, records, {}, reason,
                                              status_unrun="timeout" if timed_out else "error")}
        if batch.get("confirm"):
            confirmed_only(job.result["cells"], confirmed, cells_meta)
    if unreadable:
        job.result.setdefault("notes", []).append(f"{unreadable} unreadable record(s) from the worker ignored")
    job.result.setdefault("submitted", True)
    job.seconds = time.time() - t0
    return job
