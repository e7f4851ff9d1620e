"""``python -m autograder export DIR --format canvas|moodle|csv``: a graded batch's grades as the
file a learning-management system imports.

The grades come from ``DIR/gradebook.db`` (the batch's nbgrader gradebook, read through nbgrader's
Gradebook API: a submission's score less its late penalty, as nbgrader's CSV export computes it); who
each student is comes from the roster (:mod:`autograder.grading.roster`: ``grade --roster`` stores it as
``DIR/roster.csv``; ``export --roster`` overrides it). They are laid out:

* ``csv``: nbgrader's CSV as ``grade`` writes ``grades.csv`` (one row per student and lab, with the
  points awaiting manual grading);
* ``canvas``: Canvas's gradebook import: ``Student`` (the roster's name), ``ID`` (its LMS id),
  ``SIS User ID``, ``SIS Login ID``, ``Section``, then one column per lab, a ``Points Possible`` row
  first; the login goes into ``SIS Login ID`` (``--canvas-id sis_user``: ``SIS User ID``). A lab's
  column is named as the lab (Canvas makes a new assignment of it) unless mapped to an existing
  assignment's column, which Canvas names ``Name (id)``: ``--canvas-column LAB="Lab 1 (123456)"``;
* ``moodle``: a CSV for Moodle's grade import: ``Username``, ``Full name``, ``Email address``, ``ID
  number``, then one column per lab headed ``LAB (max N)``: Moodle's import maps a column to a grade
  item and takes the maximum from the item, not the file (a new grade item's is 100), so the header
  states it; ``--moodle-percent`` writes percentages instead, headed ``LAB (%)``, for new grade items.

A lab a student never handed in is empty (no grade), not 0; the score is nbgrader's (the automatic
points less any late penalty, plus the manual points given in formgrader). A student graded but not
on the roster keeps a row, with the login only, and is named in a warning.
"""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

from autograder.course.labs import resolve_lab
from autograder.grading.roster import ROSTER_FILE, batch_roster, not_on_roster, warning

FORMATS = ("csv", "canvas", "moodle")
CANVAS_FIXED = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
MOODLE_FIXED = ["Username", "Full name", "Email address", "ID number"]
#: how Canvas names an existing assignment's column in its gradebook export: ``Name (id)``
CANVAS_COLUMN = re.compile(r".*\S \((\d+)\)")


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


def canvas_columns(values: list[str] | None = None, file=None) -> dict[str, str]:
    """{lab as written: Canvas column} from ``LAB=COLUMN`` values (``--canvas-column``) over the lines of
    a mapping file (``--canvas-columns``: one ``LAB=COLUMN`` a line; blank lines and ``#`` comments
    skipped). A column must be an existing assignment's, as Canvas names it: ``Lab 1 (123456)``."""
    items: list[tuple[str, str]] = []
    if file:
        path = Path(file)
        if not path.is_file():
            raise SystemExit(f"--canvas-columns {path}: no such file")
        lines = path.read_text(encoding="utf-8-sig").splitlines()
        items += [(f"{path}, line {n}", line) for n, line in enumerate(lines, 1)
                  if line.strip() and not line.lstrip().startswith("#")]
    items += [("--canvas-column", v) for v in values or []]
    out: dict[str, str] = {}
    for where, item in items:
        lab, sep, column = item.partition("=")
        lab, column = lab.strip(), column.strip().strip('"')
        if not sep or not lab or not CANVAS_COLUMN.fullmatch(column):
            raise SystemExit(f"{where}: {item!r}: expected LAB=COLUMN with COLUMN an existing Canvas assignment's "
                             f"column as Canvas names it, 'Name (id)', e.g. lab1=\"Lab 1 (123456)\" (the id is the "
                             f"number in the assignment's address)")
        out[lab] = column
    return out


def _mapped(labs: list[str], mapping: dict[str, str]) -> dict[str, str]:
    """{lab of the batch: Canvas column}; the labs as written resolved as the command line does (``1``,
    ``lab1``); an unknown lab, or two labs in one column, refused."""
    out: dict[str, str] = {}
    for name, column in mapping.items():
        try:
            lab = resolve_lab(name, labs)
        except ValueError:
            raise SystemExit(f"--canvas-column {name}={column!r}: no lab {name!r} in this batch; its labs: "
                             f"{', '.join(labs)}") from None
        out[lab] = column
    twice = sorted({c for c in out.values() if list(out.values()).count(c) > 1})
    if twice:
        raise SystemExit(f"--canvas-column: two labs mapped to the column {twice[0]!r}")
    return out


def canvas(data: tuple, id_column: str = "sis_login", roster=None,
           columns: dict[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Canvas's header and rows from :func:`_table`'s ``data``."""
    labs, students, maxima = data
    columns = _mapped(labs, columns or {})
    header = CANVAS_FIXED + [columns.get(lab, lab) for lab in labs]
    table = [["Points Possible", "", "", "", ""] + [maxima.get(l, "") for l in labs]]
    for sid in sorted(students):
        s, who = students[sid], (roster or {}).get(sid)
        name = f"{s['last']}, {s['first']}" if s["last"] and s["first"] else (s["last"] or s["first"] or sid)
        ids = [sid, ""] if id_column == "sis_user" else ["", sid]
        table.append([who.name or name if who else name, who.lms_id if who else ""] + ids
                     + [who.section if who else ""] + [s.get(l, "") for l in labs])
    return header, table


def moodle(data: tuple, roster=None, percent: bool = False) -> tuple[list[str], list[list[str]]]:
    """Moodle's header and rows from :func:`_table`'s ``data``."""
    labs, students, maxima = data

    def score(value: str, lab: str) -> str:
        top = float(maxima.get(lab) or 0)
        return _num(round(100 * float(value) / top, 2)) if percent and value != "" and top > 0 else value
    header = MOODLE_FIXED + [f"{lab} (%)" if percent else f"{lab} (max {maxima.get(lab, '')})" for lab in labs]
    table = []
    for sid in sorted(students):
        s, who = students[sid], (roster or {}).get(sid)
        name = " ".join(n for n in (s["first"], s["last"]) if n)
        table.append([sid, who.name if who and who.name else name, who.email if who and who.email else s["email"],
                      who.lms_id if who else ""] + [score(s.get(l, ""), l) for l in labs])
    return header, table


def export(out: Path, fmt: str = "csv", to: Path | None = None, canvas_id: str = "sis_login", roster=None,
           columns: dict[str, str] | None = None, moodle_percent: bool = False, stream=None) -> Path:
    """Write the export of batch ``out`` in ``fmt`` to ``to`` (default ``out/grades[-FMT].csv``); ``roster``:
    a roster CSV over the batch's ``roster.csv``; ``columns``: {lab: existing Canvas column}."""
    from autograder.grading.gradebook import export_csv
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
    people = batch_roster(out, roster)
    data = _table(out)
    header, table = canvas(data, canvas_id, people, columns) if fmt == "canvas" else moodle(data, people, moodle_percent)
    missing = not_on_roster(people, data[1]) if people is not None else []
    if missing:
        print(warning(str(roster or out / ROSTER_FILE), missing), file=stream or sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(table)
    return dest
