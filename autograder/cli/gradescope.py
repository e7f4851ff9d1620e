"""``python -m autograder gradescope LAB``: ``LAB_autograder.zip`` for Gradescope, or ``--check`` an old one."""
from __future__ import annotations

from pathlib import Path

from autograder.cli.common import bundle_check

VISIBILITY = ("visible", "after_due_date", "after_published", "hidden")


def add(sub) -> None:
    s = sub.add_parser("gradescope", help="LAB_autograder.zip: Gradescope's setup.sh and run_autograder grading "
                                          "with this grader")
    s.add_argument("lab")
    s.add_argument("--out", default=".")
    s.add_argument("--hidden-visibility", choices=VISIBILITY, default="after_due_date",
                   help="visibility of a test cell with hidden tests (default: after_due_date)")
    s.add_argument("--visible-visibility", choices=VISIBILITY, default="visible",
                   help="visibility of a test cell without hidden tests (default: visible)")
    s.add_argument("--timeout", type=float, default=600,
                   help="the assignment's Gradescope timeout, s (default 600, Gradescope's default 10 minutes)")
    s.add_argument("--wall-timeout", type=float, default=None,
                   help="a submission's wall-clock limit, s: 60 to the timeout less 60 (default: the timeout less 60)")
    s.add_argument("--check", metavar="ZIP",
                   help="build nothing: say whether the course here has changed since ZIP was built, and what")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.handout.platforms.gradescope import build
    if a.check:
        return bundle_check(a)
    dest = build(a.lab, Path(a.out), a.hidden_visibility, a.visible_visibility, a.wall_timeout, a.timeout)
    print(f"{dest}: upload it as the assignment's autograder (Gradescope: Configure Autograder, Zip file upload)")
    return 0
