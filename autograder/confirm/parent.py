"""The confirmation's parent: the process that writes the confirmation's verdict, and never runs
student code (started by :mod:`autograder.confirm` inside the sandbox, as ``python -I
confirm/parent.py --fd N``; the standard library, and torch and the pristine minidist imported for its
forks only, :mod:`autograder.confirm.warm`).

It holds what the grader trusts: the descriptor the verdict goes out on and the token each line
carries. It starts :mod:`autograder.confirm.runner` (the child that runs the cells) with neither:
a fork of this process made before it read its spec (:mod:`autograder.confirm.warm`: the parent
imports torch and the pristine minidist once, for the judge and the child), sends it one cell at a time with a fresh random nonce, and forwards a
reply only if it answers the cell in flight with that cell's nonce. So student code in the child,
whatever it reaches there (a frame, a descriptor, the runner's own functions while a solution
cell runs), can at most speak for the cell it runs in: the tests' requests, and their nonces, are
sent only after the solution cells' replies are in. The parent is not dumpable, so a process of
the same uid can neither trace it nor read its memory; a child that dies, hangs past the cell
timeout or answers out of turn ends the run, and the tests not answered stay unconfirmed.

A test the child reports passed is put to the judge (:mod:`autograder.confirm.judge`, forked
first, never runs student code) with the answers the child filed for it (the docket); the test
passes only if the judge finds nothing wrong with them.

Usage: ``python -I parent.py --fd N [--preload MODULE,...]`` (``--preload``: the lab's checks
modules, imported before the forks). Protocol: a JSON spec on stdin (``token``, ``path``, ``cells`` [{id, kind, source}], ``timeout``,
``workdir``, ``env``, ``hidden``: the lab's hidden case tables, which the judge and the child serve to
their imports, :mod:`autograder.confirm.hidden_tables`); JSON lines on the inherited descriptor named by ``--fd``: ``cell``,
``test``, ``restored``, ``flags`` and, when every cell was answered, ``done``.
"""
import ctypes
import json
import os
import secrets
import signal
import sys
import time

# the folder holding autograder/confirm/ and minidist/ (the pristine copy; -I leaves it off the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from autograder.confirm import warm, wire  # noqa: E402

PR_SET_DUMPABLE = 4
MARGIN = 30            # seconds past the cell timeout before the parent gives up on the child


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)       # the forks inherit it: undumpable from their first instruction
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    preload = sys.argv[sys.argv.index("--preload") + 1].split(",") if "--preload" in sys.argv else []
    keep = warm.preload(preload)
    from autograder.confirm import judge as judge_main, runner as runner_main      # preloaded
    # both forks before the spec is read: neither holds the token, the cells or the hidden tables but as
    # sent to it; the judge first (it never runs student code)
    judge = warm.fork(judge_main.main, keep)
    child = warm.fork(runner_main.main, keep)
    spec = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(fd), "w", buffering=1)
    os.close(fd)
    token = spec["token"]

    def report(**msg):
        out.write(json.dumps(dict(msg, token=token), default=str) + "\n")

    wire.send(judge[1], {"path": spec.get("path", []), "cells": spec["cells"], "hidden": spec.get("hidden", {})})
    cmd, replies = child[1], child[2]
    timeout = float(spec.get("timeout") or 600) + MARGIN
    t_start = time.time()
    answered = 0
    try:
        wire.send(cmd, {"path": spec.get("path", []), "workdir": spec.get("workdir"), "env": spec.get("env", {}),
                        "timeout": spec.get("timeout"), "own_pids": bool(spec.get("own_pids")), "keep": [judge[0]],
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
        for pid, *_ in (child, judge):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    if answered == len(spec["cells"]):
        report(event="done", seconds=round(time.time() - t_start, 2))
    out.flush()
    os._exit(0)


def judged(judge, cell: str, docket, timeout: float):
    """The judge's verdict on a test the child reported passed (:mod:`autograder.confirm.judge`; ``judge``:
    its pid and the descriptors to write to it and read from it): None if it agrees, else the test's
    error. A judge that fails to answer leaves the test unconfirmed."""
    try:
        wire.send(judge[1], {"cell": cell, "docket": docket if isinstance(docket, list) else []})
    except OSError:
        return ["JudgeError", "the confirmation's judge is gone"]
    verdict = wire.recv(judge[2], timeout)
    if not (isinstance(verdict, dict) and verdict.get("cell") == cell):
        return ["JudgeError", "the confirmation's judge did not answer"]
    if verdict.get("problem"):
        return ["AssertionError", f"{verdict['problem']} (the verdict given again, from the answers the graded "
                                  "code gave, by a process that ran no student code)"]
    return None


if __name__ == "__main__":
    main()
