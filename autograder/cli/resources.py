"""``python -m autograder resources``: per lab, what grading its solution takes on one CPU."""
from __future__ import annotations


def add(sub) -> None:
    s = sub.add_parser("resources", help="per lab: wall time and peak memory (process tree) of grading the solution "
                                         "as run_autograder does, pinned to one CPU")
    s.add_argument("--lab", action="append", help="default: every lab")
    s.add_argument("--cpu", type=int, default=0, help="the CPU to pin to (taskset -c; default 0)")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.handout.platforms.resources import main as measure
    rows = measure(a.lab, a.cpu)
    return 0 if all(r["ok"] for r in rows) else 1
