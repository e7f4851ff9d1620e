"""The nbgrader gradebooks: due dates into the template's, a job's scores into its own, the class's merged,
late penalties, CSV out.

Everything goes through nbgrader's Gradebook API and plugins. Scores of autograded tests are
the grader's (confirmed, clamped) points: a manual score is never kept for them, whatever a
per-job gradebook says.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from autograder.course.config import load_config
from autograder.grading.records import Job


def merge_gradebook(template: Path, out: Path, jobs: list[Job]) -> Path:
    """One nbgrader gradebook for the whole class, then nbgrader's CSV export. Scores of
    autograded tests are the (confirmed, clamped) points; a manual score is never kept for them."""
    from nbgrader.api import Gradebook

    db = out / "gradebook.db"
    if db.exists():
        db.unlink()
    shutil.copy(template / "gradebook.db", db)
    url = "sqlite:///" + str(db)
    import warnings
    with warnings.catch_warnings(), Gradebook(url) as gb:
        warnings.simplefilter("ignore")  # SQLAlchemy autoflush notes from nbgrader's API
        for s in sorted({j.student for j in jobs}):
            gb.update_or_create_student(s)
        for j in jobs:
            if not j.result.get("submitted", True):
                continue
            kw = {}
            if j.result.get("timestamp"):
                from nbgrader.utils import parse_utc
                try:
                    kw["timestamp"] = parse_utc(j.result["timestamp"])
                except Exception:
                    pass
            gb.update_or_create_submission(j.lab, j.student, **kw)
            for nb, rows in j.result["cells"].items():
                for cell, row in rows.items():
                    g = gb.find_grade(cell, nb, j.lab, j.student)
                    if row["status"] == "manual":     # a written answer: the instructor's to grade
                        g.needs_manual_grade = g.manual_score is None
                        continue
                    g.auto_score = min(float(row["points"] or 0.0), float(g.max_score))
                    g.manual_score = None
                    g.needs_manual_grade = False
                penalty = (j.result.get("late_penalty") or {}).get(nb)
                if penalty:
                    snb = gb.find_submission_notebook(nb, j.lab, j.student)
                    snb.late_submission_penalty = min(float(penalty), float(snb.score))
            gb.db.commit()
    return db


def set_due_dates(template: Path, dates: dict[str, str]) -> dict[str, str]:
    """Write the labs' due dates into the template gradebook (every job's copy and the merged one
    inherit them): nbgrader then computes how late each submission is from its timestamp."""
    from nbgrader.api import Gradebook
    from nbgrader.utils import parse_utc
    done = {}
    with Gradebook("sqlite:///" + str(template / "gradebook.db")) as gb:
        for lab, date in dates.items():
            try:
                gb.find_assignment(lab)
            except Exception:
                continue
            when = parse_utc(date)
            gb.update_or_create_assignment(lab, duedate=when)
            done[lab] = when.isoformat()
    return done


#: columns ``grades.csv`` has after nbgrader's own: points still to be graded by hand (a written
#: answer) and whether any are, so that a solution's automatic 9/12 does not read as 75 %
PENDING_FIELDS = ("manual_points_pending", "needs_manual_grade")


def export_csv(db: Path, dest: Path) -> None:
    """nbgrader's CSV export, plus :data:`PENDING_FIELDS` per row (from the gradebook: the maximum
    of every manually graded cell that has no manual score yet)."""
    import csv

    from nbgrader.api import Gradebook, MissingEntry
    from nbgrader.plugins.export import CsvExportPlugin

    with Gradebook("sqlite:///" + str(db)) as gb:
        plugin = CsvExportPlugin(to=str(dest))
        plugin.export(gb)
        with open(dest, newline="") as f:
            rows = list(csv.DictReader(f))
            fields = list(rows[0]) if rows else []
        for row in rows:
            pending = 0.0
            try:
                sub = gb.find_submission(row["assignment"], row["student_id"])
            except MissingEntry:
                sub = None
            for nb in sub.notebooks if sub is not None else []:
                pending += sum(float(g.max_score or 0) for g in nb.grades
                               if g.needs_manual_grade and g.manual_score is None)
            row.update(manual_points_pending=f"{pending:g}", needs_manual_grade=str(pending > 0))
    if rows:
        with open(dest, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields + [k for k in PENDING_FIELDS if k not in fields],
                               lineterminator="\n")
            w.writeheader()
            w.writerows(rows)


def record_scores(course: Path, lab: str, student: str, result: dict) -> None:
    """A job's final (confirmed) scores into its own gradebook, so that nbgrader's feedback shows them;
    the submission's time and late penalties (:func:`late_penalties`) into ``result``, with a note."""
    from nbgrader.api import Gradebook

    with Gradebook("sqlite:///" + str(Path(course) / "gradebook.db")) as gb:
        for name, rows in result["cells"].items():
            for cell, row in rows.items():
                if row["status"] == "manual":
                    continue
                g = gb.find_grade(cell, name, lab, student)
                g.auto_score = float(row["points"] or 0.0)
                g.manual_score = None
                g.needs_manual_grade = False
        gb.db.commit()
        sub = gb.find_submission(lab, student)
        result["timestamp"] = sub.timestamp.isoformat() if sub.timestamp else None
        result["late_penalty"] = late_penalties(gb, course, lab, student, sub, list(result["cells"]))
        if result["late_penalty"]:
            result["notes"].append(f"submitted {sub.total_seconds_late / 3600:.1f} h late: penalty "
                                   + ", ".join(f"{v:g}" for v in result["late_penalty"].values()))

def late_penalties(gb, course, lab, student, sub, names) -> dict:
    """nbgrader's late-submission plugin (the course config's), on the final (confirmed) scores."""
    if not sub.total_seconds_late or sub.total_seconds_late <= 0:
        return {}
    from traitlets.utils.importstring import import_item
    c = load_config(root=course)
    cls = c.AssignLatePenalties.plugin_class if "plugin_class" in c.AssignLatePenalties else None
    cls = import_item(cls) if isinstance(cls, str) else cls
    if cls is None:
        from nbgrader.plugins import LateSubmissionPlugin as cls
    plugin = cls(config=c)
    out = {}
    for name in names:
        snb = gb.find_submission_notebook(name, lab, student)
        penalty = plugin.late_submission_penalty(student, snb.score, sub.total_seconds_late)
        snb.late_submission_penalty = None if penalty is None else min(max(float(penalty), 0.0), float(snb.score))
        if snb.late_submission_penalty:
            out[name] = snb.late_submission_penalty
    gb.db.commit()
    return out
