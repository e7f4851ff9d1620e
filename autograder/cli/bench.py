"""``python -m autograder bench``: how long grading takes here, per mode and per ``--jobs``."""
from __future__ import annotations


def add(sub) -> None:
    s = sub.add_parser("bench", help="seconds per submission with confirmation + sandbox and without, "
                                     "and --jobs 1 vs 2 on N submissions")
    s.add_argument("--lab", default=None, help="default: the first lab under solutions/")
    s.add_argument("-n", type=int, default=8, help="copies graded with each --jobs value (0: skip)")
    s.add_argument("--repeat", type=int, default=1, help="grade the single submission this often per mode")
    s.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.selftest.bench import bench
    bench(lab=a.lab, n=a.n, jobs=a.jobs, repeat=a.repeat)
    return 0
