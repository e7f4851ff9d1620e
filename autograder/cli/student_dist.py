"""``python -m autograder student-dist OUT``: what students get."""
from __future__ import annotations

import sys
from pathlib import Path


def add(sub) -> None:
    s = sub.add_parser("student-dist", help="OUT: what students get: the released labs, a wheel of the minidist "
                                            "library without hidden cases, a README (no solutions, no bug bank)")
    s.add_argument("out", metavar="OUT", help="the folder to write (new, empty, or an earlier distribution)")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.handout.student_dist import build
    try:
        built = build(Path(a.out))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{a.out}: {len(built['labs'])} labs, {built['wheel'].relative_to(Path(a.out).resolve())}, README.md "
          f"(no solutions, no bug bank, no hidden cases): hand this folder to students")
    return 0
