"""``python -m autograder feedback OUT [--to DIR]``: the feedback checked for hidden-test source, and
copied per student for handing back."""
from __future__ import annotations

import sys
from pathlib import Path


def add(sub) -> None:
    s = sub.add_parser("feedback", help="check a graded OUT/feedback for hidden-test leaks and "
                                        "copy it to --to DIR/<student>/<lab>/ for handing back")
    s.add_argument("out")
    s.add_argument("--to")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.reports.feedback import collect
    made, leaks = collect(Path(a.out), Path(a.to) if a.to else None)
    for p in made:
        print(p)
    for l in leaks:
        print("LEAK:", l, file=sys.stderr)
    return 1 if leaks else 0
