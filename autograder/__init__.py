"""Course tooling for minidist: release labs, grade a class with nbgrader, self-test.

Run ``python -m autograder --help``.  The autograder imports minidist; minidist
never imports the autograder.

Its packages, from the ground up (each ``__init__`` gives its own reading order):

1. :mod:`.course`: the course as the grader reads it (where the labs are, their cells, the nbgrader
   configuration and pinned kernel, the template course);
2. :mod:`.sandbox`: a sandbox per kernel, and every process of a job killed at its end;
3. :mod:`.confirm`: every graded test again, outside the student's kernel, judged apart;
4. :mod:`.grading`: a class graded, each submission in a worker of its own, and what ``grade`` writes;
5. :mod:`.reports` (feedback, LMS exports, similarity) and :mod:`.handout` (the release, the student
   distribution, the platforms' bundles, the exercise scaffold);
6. :mod:`.selftest`: every lab's tests checked against its bug bank (``solutions/<lab>/bugbank.py``);
7. :mod:`.cli`: one module per command; ``__main__`` dispatches.

This file is copied next to the pristine minidist for the confirmation (:mod:`autograder.confirm.start`):
it imports nothing but the standard library.
"""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO = PACKAGE_DIR.parent
