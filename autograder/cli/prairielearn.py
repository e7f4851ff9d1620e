"""``python -m autograder prairielearn LAB --image NAME``: a PrairieLearn question and its grader image, or
``--check`` an old one."""
from __future__ import annotations

from pathlib import Path

from autograder.cli.common import bundle_check


def add(sub) -> None:
    s = sub.add_parser("prairielearn", help="a PrairieLearn external-grading question for LAB and its grader image")
    s.add_argument("lab")
    s.add_argument("--out", default=".")
    s.add_argument("--image", help="required: the name the grader image is pushed under, for info.json "
                                   "(e.g. yourorg/minidist-grader-lab1)")
    s.add_argument("--timeout", type=int, default=600,
                   help="info.json's grading timeout, s: 120 to 600, PrairieLearn's maximum (default 600); "
                        "a submission's wall-clock limit is 60 s less")
    s.add_argument("--check", metavar="DIR",
                   help="build nothing: say whether the course here has changed since DIR (the output folder "
                        "or grader-image/) was built, and what")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.handout.platforms.prairielearn import build
    if a.check:
        return bundle_check(a)
    dest = build(a.lab, Path(a.out), a.image, a.timeout)
    print(f"{dest}/questions: copy into the course repository's questions/; "
          f"{dest}/grader-image: build it (docker build -t IMAGE .), push it, name it in info.json")
    return 0
