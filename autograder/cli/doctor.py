"""``python -m autograder doctor``: which sandbox grading would use here, and what it guarantees."""
from __future__ import annotations

import os


def add(sub) -> None:
    s = sub.add_parser("doctor", help="which sandbox grading would use here, and what it guarantees")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder import REPO
    from autograder.sandbox.probe import JobsCannotReach, probe
    try:
        backend, what = probe(hidden=[str(REPO / "solutions"), str(REPO / "autograder")])
    except JobsCannotReach as err:
        print(err)
        return 1
    who = "root (each job drops to its own unprivileged uid)" if os.geteuid() == 0 else f"uid {os.getuid()}"
    print(f"grader: {who}")
    print(f"sandbox: {what}" if backend else f"sandbox: NONE: {what}")
    return 0 if backend else 1
