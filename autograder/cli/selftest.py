"""``python -m autograder selftest``: every lab's solution, release, bugs and correct alternatives graded."""
from __future__ import annotations

from pathlib import Path

from autograder.cli.common import add_timing


def add(sub) -> None:
    s = sub.add_parser("selftest", help="solution = full marks, release = 0, every bank bug caught, "
                                        "every correct alternative full marks")
    s.add_argument("--lab", action="append")
    s.add_argument("--jobs", type=int, default=2)
    s.add_argument("--out", help="keep the selftest's grading output here")
    s.add_argument("--quick", action="store_true",
                   help="grade the solution with nbgrader, check the release, the bugs and the alternatives "
                        "in kernels (minutes instead of tens of minutes; what `make test` runs)")
    s.add_argument("--gpus-per-job", type=int, default=None, metavar="K", help="as grade's (GPU nodes)")
    add_timing(s)
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.selftest.selftest import selftest
    ok = selftest(labs=a.lab, jobs=a.jobs, out=Path(a.out) if a.out else None,
                  cell_timeout_s=a.cell_timeout, wall_s=a.wall_timeout, progress=not a.quiet, quick=a.quick,
                  gpus_per_job=a.gpus_per_job)
    return 0 if ok else 1
