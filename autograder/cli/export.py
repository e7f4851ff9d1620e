"""``python -m autograder export OUT --format csv|canvas|moodle``: a graded batch's grades for an LMS."""
from __future__ import annotations

from pathlib import Path


def add(sub) -> None:
    s = sub.add_parser("export", help="the grades of OUT/gradebook.db as a file an LMS imports (csv: nbgrader's "
                                      "CSV, OUT/grades.csv; canvas, moodle: OUT/grades-FORMAT.csv)")
    s.add_argument("out")
    s.add_argument("--to")
    s.add_argument("--format", choices=("csv", "canvas", "moodle"), default="csv")
    s.add_argument("--canvas-id", choices=("sis_login", "sis_user"), default="sis_login",
                   help="the Canvas column that holds the student's login (default: SIS Login ID)")
    s.add_argument("--roster", metavar="CSV",
                   help="the class roster (as grade --roster's), over the one grade stored in OUT/roster.csv")
    s.add_argument("--canvas-column", action="append", metavar='LAB="NAME (ID)"',
                   help="put LAB's grades in an existing Canvas assignment's column, named as Canvas names it "
                        "(e.g. lab1=\"Lab 1 (123456)\"); repeatable")
    s.add_argument("--canvas-columns", metavar="FILE", help="the same mapping from a file, one LAB=COLUMN a line")
    s.add_argument("--moodle-percent", action="store_true",
                   help="Moodle: grades as percentages of each lab's maximum (for new grade items, whose maximum "
                        "is 100), instead of points")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.reports.export import canvas_columns, export
    columns = canvas_columns(a.canvas_column, a.canvas_columns)
    if columns and a.format != "canvas":
        raise SystemExit(f"--canvas-column and --canvas-columns are for --format canvas, not {a.format}")
    if a.roster and a.format == "csv":
        raise SystemExit("--roster is for --format canvas or moodle (csv is nbgrader's own export)")
    if a.moodle_percent and a.format != "moodle":
        raise SystemExit(f"--moodle-percent is for --format moodle, not {a.format}")
    print(export(Path(a.out), a.format, Path(a.to) if a.to else None, a.canvas_id, roster=a.roster,
                 columns=columns, moodle_percent=a.moodle_percent))
    return 0
