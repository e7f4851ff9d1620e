"""``python -m autograder new-exercise LAB NAME``: the skeleton of one more graded exercise."""
from __future__ import annotations


def add(sub) -> None:
    s = sub.add_parser("new-exercise", help="add the skeleton of a graded exercise to LAB: its cells in the source "
                                            "notebook, its check in the lab's checks folder, stub bank entries")
    s.add_argument("lab")
    s.add_argument("name", help="the graded function's name")
    s.add_argument("--args", default="x", help="its parameters, as written in its def (default: x)")
    s.add_argument("--points", type=int, default=2, help="the test cell's points (default: 2)")
    s.add_argument("--where", choices=("here", "launch"), default="here",
                   help="where the answer is made: in the grading process, or on the ranks of a launch")
    s.add_argument("--after", help="insert after the cell of this grade_id (default: at the end)")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.handout.scaffold import new_exercise
    written = new_exercise(a.lab, a.name, args=a.args, points=a.points, where=a.where, after=a.after)
    print(f"exercise {a.name!r} added to {a.lab}; fill in (docs/AUTHORING.md):")
    for path in written:
        print(f"  {path}")
    return 0
