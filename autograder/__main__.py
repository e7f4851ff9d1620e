"""python -m autograder COMMAND: release the labs, grade a class and report on it, build what grading platforms
and students get, self-test the grader (COMMAND --help: its options)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from autograder.cli import (bench, doctor, export, feedback, grade, gradescope, new_exercise, prairielearn,
                            release, resources, selftest, similarity, student_dist)
from autograder.course.labs import resolve_lab

#: the commands, in the order --help lists them: each module of autograder/cli/ adds its sub-parser (``add``) and
#: runs it (``run``); this only dispatches
COMMANDS = (release, grade, similarity, feedback, export, gradescope, prairielearn, selftest, bench, resources,
            new_exercise, student_dist, doctor)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder", description=__doc__)
    p.add_argument("--solutions", help="course source directory (default: solutions/; "
                                       "also $MINIDIST_SOLUTIONS)")
    p.add_argument("--labs-dir", help="release directory (default: labs/)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.add(sub)
    a = p.parse_args(argv)
    for flag, var in (("solutions", "MINIDIST_SOLUTIONS"), ("labs_dir", "MINIDIST_LABS")):
        if getattr(a, flag):
            os.environ[var] = str(Path(getattr(a, flag)).resolve())
    try:
        for flag in ("lab", "labs"):
            value = getattr(a, flag, None)
            if value:
                setattr(a, flag, resolve_lab(value) if isinstance(value, str) else [resolve_lab(v) for v in value])
    except ValueError as e:
        p.error(str(e))
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
