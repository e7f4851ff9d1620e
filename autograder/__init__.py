"""Course tooling for minidist: release labs, grade a class with nbgrader, self-test.

Run ``python -m autograder --help``.  The autograder imports minidist; minidist
never imports the autograder.
"""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO = PACKAGE_DIR.parent
