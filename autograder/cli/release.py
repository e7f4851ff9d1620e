"""``python -m autograder release [LAB ...] [--check]``: ``labs/`` made from ``solutions/``, or checked."""
from __future__ import annotations

import sys


def add(sub) -> None:
    s = sub.add_parser("release", help="regenerate labs/ from solutions/ (nbgrader generate_assignment)")
    s.add_argument("labs", nargs="*", help="labs to release (default: all)")
    s.add_argument("--check", action="store_true", help="only check that labs/ is up to date")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.handout import release
    if a.check:
        problems = release.check()
        for p in problems:
            print(p)
        if problems:
            print("labs/ is out of date: run `python -m autograder release`", file=sys.stderr)
            return 1
        print("labs/ matches a fresh release")
        return 0
    done = release.release(a.labs or None)
    print("released:", ", ".join(done) if done else "(no labs under solutions/)")
    return 0
