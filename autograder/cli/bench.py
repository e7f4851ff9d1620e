"""``python -m autograder bench``: how long grading takes here, per mode and per ``--jobs``."""
from __future__ import annotations


def add(sub) -> None:
    s = sub.add_parser("bench", help="seconds per submission with confirmation + sandbox and without, "
                                     "and --jobs 1 vs 2 on N submissions")
    s.add_argument("--lab", default=None, help="default: the first lab under solutions/")
    s.add_argument("-n", type=int, default=8, help="copies graded with each --jobs value (0: skip)")
    s.add_argument("--repeat", type=int, default=1, help="grade the single submission this often per mode")
    s.add_argument("--jobs", type=int, nargs="+", default=None, help="default: 1 and 2 (with --class: 1)")
    s.add_argument("--class", dest="klass", type=int, default=None, metavar="N",
                   help="instead: grade N copies of the lab's solution with each --jobs value, with and without "
                        "the confirmation, --repeat times each; submissions per hour and CPU-seconds per submission")
    s.set_defaults(fn=run)


def run(a) -> int:
    if a.klass is not None:
        from autograder.course.labs import all_labs
        from autograder.selftest.throughput import class_bench
        labs = all_labs()
        if a.lab is None and not labs:
            raise SystemExit("bench: no labs under solutions/")
        class_bench(a.lab or labs[0], a.klass, jobs=a.jobs or [1], repeat=a.repeat)
        return 0
    from autograder.selftest.bench import bench
    bench(lab=a.lab, n=a.n, jobs=a.jobs or [1, 2], repeat=a.repeat)
    return 0
