"""The confirmation's parent: the process that writes the confirmation's verdict, and never runs
student code (started by :mod:`autograder.confirm` inside the sandbox, as ``python -I
confirm/parent.py --fd N``; standard library and minidist.protocol only).

It holds what the grader trusts: the descriptor the verdict goes out on and the token each line
carries. It starts :mod:`autograder.confirm.runner` (the child that runs the cells) as a fresh
interpreter with neither, sends it one cell at a time with a fresh random nonce, and forwards a
reply only if it answers the cell in flight with that cell's nonce. So student code in the child,
whatever it reaches there (a frame, a descriptor, the runner's own functions while a solution
cell runs), can at most speak for the cell it runs in: the tests' requests, and their nonces, are
sent only after the solution cells' replies are in. The parent is not dumpable, so a process of
the same uid can neither trace it nor read its memory; a child that dies, hangs past the cell
timeout or answers out of turn ends the run, and the tests not answered stay unconfirmed.

A test the child reports passed is put to the judge (:mod:`autograder.confirm.judge`, started
first, never runs student code) with the answers the child filed for it (the docket); the test
passes only if the judge finds nothing wrong with them.

Protocol: a JSON spec on stdin (``token``, ``path``, ``cells`` [{id, kind, source}], ``timeout``,
``workdir``, ``env``, ``hidden``: the lab's hidden case tables, which the judge and the child serve to
their imports, :mod:`autograder.confirm.hidden_tables`); JSON lines on the inherited descriptor named by ``--fd``: ``cell``,
``test``, ``restored``, ``flags`` and, when every cell was answered, ``done``.
"""
import ctypes
import json
import os
import secrets
import subprocess
import sys
import time

# the folder holding autograder/confirm/ and minidist/ (the pristine copy; -I leaves it off the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from autograder.confirm import wire  # noqa: E402

PR_SET_DUMPABLE = 4
MARGIN = 30            # seconds past the cell timeout before the parent gives up on the child


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    spec = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(fd), "w", buffering=1)
    os.close(fd)
    token = spec["token"]

    def report(**msg):
        out.write(json.dumps(dict(msg, token=token), default=str) + "\n")

    here = os.path.dirname(os.path.abspath(__file__))
    # the judge first: it makes itself undumpable before the child runs any student code
    judge = subprocess.Popen([sys.executable, "-I", os.path.join(here, "judge.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=spec.get("workdir") or None, close_fds=True)
    wire.send(judge.stdin.fileno(), {"path": spec.get("path", []), "cells": spec["cells"],
                                     "hidden": spec.get("hidden", {})})
    child = subprocess.Popen([sys.executable, "-I", os.path.join(here, "runner.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=spec.get("workdir") or None, close_fds=True)
    cmd, replies = child.stdin.fileno(), child.stdout.fileno()
    timeout = float(spec.get("timeout") or 600) + MARGIN
    t_start = time.time()
    answered = 0
    try:
        wire.send(cmd, {"path": spec.get("path", []), "workdir": spec.get("workdir"), "env": spec.get("env", {}),
                        "timeout": spec.get("timeout"), "own_pids": bool(spec.get("own_pids")), "keep": [judge.pid],
                        "hidden": spec.get("hidden", {})})
        for cell in spec["cells"]:
            nonce = secrets.token_hex(16)
            wire.send(cmd, {"cell": dict(cell), "nonce": nonce})
            reply = wire.recv(replies, timeout)
            if not (isinstance(reply, dict) and reply.get("nonce") == nonce and reply.get("cell") == cell["id"]):
                if reply is not None:
                    report(event="flags", items=[["the confirmation's child answered out of turn",
                                                  f"while cell {cell['id']} ran"]])
                break
            answered += 1
            flags = [f for f in reply.get("flags") or [] if isinstance(f, list)]
            if flags:
                report(event="flags", items=flags[:50])
            if cell["kind"] == "test":
                if reply.get("restored"):
                    report(event="restored", cell=cell["id"], changes=list(reply["restored"])[:20])
                if not reply.get("error"):
                    reply["error"] = judged(judge, cell["id"], reply.get("docket"), timeout)
                report(event="test", cell=cell["id"], error=reply.get("error"), stderr=str(reply.get("stderr") or "")[:2000],
                       value=reply.get("value"), changed=list(reply.get("changed") or [])[:20],
                       seconds=reply.get("seconds"))
            else:
                report(event="cell", cell=cell["id"], kind=cell["kind"], error=reply.get("error"))
    except OSError:
        pass
    finally:
        for proc in (child, judge):
            proc.kill()
            proc.wait()
    if answered == len(spec["cells"]):
        report(event="done", seconds=round(time.time() - t_start, 2))
    out.flush()
    os._exit(0)


def judged(judge, cell: str, docket, timeout: float):
    """The judge's verdict on a test the child reported passed (:mod:`autograder.confirm.judge`): None
    if it agrees, else the test's error. A judge that fails to answer leaves the test unconfirmed."""
    try:
        wire.send(judge.stdin.fileno(), {"cell": cell, "docket": docket if isinstance(docket, list) else []})
    except OSError:
        return ["JudgeError", "the confirmation's judge is gone"]
    verdict = wire.recv(judge.stdout.fileno(), timeout)
    if not (isinstance(verdict, dict) and verdict.get("cell") == cell):
        return ["JudgeError", "the confirmation's judge did not answer"]
    if verdict.get("problem"):
        return ["AssertionError", f"{verdict['problem']} (the verdict given again, from the answers the graded "
                                  "code gave, by a process that ran no student code)"]
    return None


if __name__ == "__main__":
    main()
