"""``python -m autograder export DIR --format canvas|moodle|csv``: a graded batch's grades as the
file a learning-management system imports.

The grades come from ``DIR/gradebook.db`` (the batch's nbgrader gradebook, read through nbgrader's
Gradebook API: a submission's score less its late penalty, as nbgrader's CSV export computes it) and
are laid out:

* ``csv``: nbgrader's CSV as ``grade`` writes ``grades.csv`` (one row per student and lab, with the
  points awaiting manual grading);
* ``canvas``: Canvas's gradebook import: ``Student``, ``ID``, ``SIS User ID``, ``SIS Login ID``,
  ``Section``, then one column per lab (the assignment, named as the lab), a ``Points Possible``
  row first; the student id goes into ``SIS Login ID`` (``--canvas-id sis_user`` for ``SIS User ID``),
  which Canvas matches when ``ID`` is empty;
* ``moodle``: a CSV for Moodle's grade import: ``Username``, ``Email address``, then one column per
  lab; the import maps ``Username`` (or the email) to the user and each lab column to a grade item.

A lab a student never handed in is empty (no grade), not 0; the score is nbgrader's (the automatic
points less any late penalty, plus the manual points given in formgrader).
"""
from __future__ import annotations

import csv
from pathlib import Path

FORMATS = ("csv", "canvas", "moodle")
CANVAS_FIXED = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
MOODLE_FIXED = ["Username", "Email address"]


def _table(out: Path) -> tuple[list[str], dict[str, dict], dict[str, str]]:
    """(labs, {student: {first, last, email, lab: score}}, {lab: max score}) from ``out/gradebook.db``
    through nbgrader's Gradebook API; a lab the student never handed in is empty, not 0."""
    from nbgrader.api import Gradebook, MissingEntry
    db = Path(out) / "gradebook.db"
    if not db.is_file():
        raise SystemExit(f"no gradebook {db}: export reads a batch graded by `python -m autograder grade`")
    students: dict[str, dict] = {}
    maxima: dict[str, str] = {}
    with Gradebook("sqlite:///" + str(db)) as gb:
        labs = sorted(a.name for a in gb.assignments)
        for a in gb.assignments:
            maxima[a.name] = _num(a.max_score)
        for st in gb.students:
            row = students.setdefault(st.id, {"first": st.first_name or "", "last": st.last_name or "",
                                              "email": st.email or ""})
            for lab in labs:
                try:
                    sub = gb.find_submission(lab, st.id)
                except MissingEntry:
                    row[lab] = ""
                    continue
                row[lab] = _num(max(0.0, float(sub.score or 0) - float(sub.late_submission_penalty or 0)))
    return labs, students, maxima


def _num(v) -> str:
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return ""


def canvas(out: Path, id_column: str = "sis_login") -> tuple[list[str], list[list[str]]]:
    labs, students, maxima = _table(out)
    header = CANVAS_FIXED + labs
    table = [["Points Possible", "", "", "", ""] + [maxima.get(l, "") for l in labs]]
    for sid in sorted(students):
        s = students[sid]
        name = f"{s['last']}, {s['first']}" if s["last"] and s["first"] else (s["last"] or s["first"] or sid)
        ids = [sid, ""] if id_column == "sis_user" else ["", sid]
        table.append([name, ""] + ids + [""] + [s.get(l, "") for l in labs])
    return header, table


def moodle(out: Path) -> tuple[list[str], list[list[str]]]:
    labs, students, _ = _table(out)
    return MOODLE_FIXED + labs, [[sid, students[sid]["email"]] + [students[sid].get(l, "") for l in labs]
                                 for sid in sorted(students)]


def export(out: Path, fmt: str = "csv", to: Path | None = None, canvas_id: str = "sis_login") -> Path:
    """Write the export of batch ``out`` in ``fmt`` to ``to`` (default ``out/grades[-FMT].csv``)."""
    from autograder.gradebook import export_csv
    out = Path(out)
    if fmt not in FORMATS:
        raise SystemExit(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    dest = Path(to) if to else out / ("grades.csv" if fmt == "csv" else f"grades-{fmt}.csv")
    if fmt == "csv":
        if not (out / "gradebook.db").is_file():
            raise SystemExit(f"no gradebook {out / 'gradebook.db'}: export reads a batch graded by "
                             "`python -m autograder grade`")
        export_csv(out / "gradebook.db", dest)
        return dest
    header, table = canvas(out, canvas_id) if fmt == "canvas" else moodle(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(table)
    return dest
