"""The worker process: one submission graded in a process of its own, which the grader supervises
(:mod:`autograder.grading.supervise`).

It is a fork of the supervisor's forkserver, which imported nbgrader and the grading modules once
(:data:`PRELOAD`: importing them takes seconds). :func:`child_entry` puts it in a new session with
the job's environment (its kill tag, :mod:`autograder.sandbox.procs`) and its output in the job's log,
runs the job (:func:`autograder.grading.worker.job.run`), and talks to the supervisor only through a
pipe: progress records as cells run, the confirmation's points, then the result or the error.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback

PRELOAD = ["autograder.grading.worker.job", "autograder.grading.worker.nbext", "autograder.sandbox.kernel",
           "autograder.confirm.start", "autograder.confirm.points", "autograder.grading.gradebook",
           "autograder.grading.worker.flags", "nbgrader.converters", "nbgrader.api", "nbgrader.coursedir",
           "nbgrader.preprocessors", "nbconvert.exporters", "jupyter_client.manager", "nbclient"]


def child_entry(spec: dict, env: dict, log_path: str, conn) -> None:
    """Entry point in a process forked from the forkserver (see autograder.grading.supervise): a new
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
        from autograder.grading.worker.job import run     # preloaded in the forkserver
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
