"""One platform submission, graded by the one grading core, as a list of tests a platform can report.

A platform hands the grader a folder (Gradescope's ``/autograder/submission``, PrairieLearn's
``/grade/student``) that should hold the lab's notebook. What it holds decides what happens:

* the lab's notebook(s), possibly wrongly named (accepted and flagged, as ``grade`` does), possibly
  next to other files (copied next to it, listed) -> graded by :func:`autograder.grading.batch.grade_one`: the
  locked cells restored, the hidden tests, the confirmation and its judge, the sandbox where one works;
* a notebook that is not JSON -> graded all the same: the core gives every test 0 with the reason;
* no notebook at all, or several notebooks none of which has the lab's name -> not graded: every
  test 0 with a reason that says what to upload (:attr:`Outcome.problem`).

A test cell is scored in parts (:mod:`autograder.course.hidden_tests`): its visible tests and, where it has them,
its hidden tests, each with its share of the cell's points (platforms show the hidden part after the due
date); a solution cell that is graded by hand (lab 7's written answer) is ``manual``: listed, never
scored here.

A failure of the grader itself is never a score: :func:`grade_folder` raises :class:`GraderFailure`
(a lab the bundle lacks, the core's result marked as the grader's failure,
:func:`autograder.grading.records.grader_fault`), and a platform reports it, as any exception of the grader,
as its own kind of error (:func:`clear_results`: no results file on Gradescope).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from autograder.course.cells import grade_id, nbg, read_nb
from autograder.course.hidden_tests import has_hidden, hidden_points
from autograder.course.labs import lab_notebooks, solutions_dir


@dataclass
class Part:
    """One part of a test cell (:mod:`autograder.course.hidden_tests`): its visible tests or its hidden tests."""
    name: str                      # "visible" or "hidden"
    points: float
    max_points: float
    status: str
    reason: str

    @property
    def passed(self) -> bool:
        return self.points >= self.max_points - 1e-9


class GraderFailure(Exception):
    """The grader could not grade (not the submission's fault): the platform reports an error, no score."""


@dataclass
class Test:
    notebook: str
    name: str                      # the test cell's grade id
    points: float                  # 0 for manual cells (not scored here)
    max_points: float
    status: str                    # pass / fail / error / timeout / manual
    reason: str                    # one line
    flags: list[str] = field(default_factory=list)
    hidden: bool = False           # the cell has hidden tests (its second part)
    manual: bool = False
    parts: list[Part] = field(default_factory=list)     # the visible part, then the hidden part if any

    @property
    def passed(self) -> bool:
        return self.status == "pass" and self.points >= self.max_points


@dataclass
class Outcome:
    lab: str
    tests: list[Test]
    problem: str | None = None     # why the submission could not be graded (nothing of it ran)
    failure: str | None = None     # what stopped grading part-way (the core's reason)
    notes: list[str] = field(default_factory=list)
    sandbox: str = ""
    confirmation: bool = True
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return sum(t.points for t in self.tests if not t.manual)

    @property
    def max_score(self) -> float:
        return sum(t.max_points for t in self.tests if not t.manual)

    @property
    def manual_points(self) -> float:
        return sum(t.max_points for t in self.tests if t.manual)

    def summary(self) -> str:
        """One paragraph for the student: the score, what went wrong, how it was graded."""
        lines = [f"{self.lab}: {self.score:g} / {self.max_score:g} points on the automatic tests"
                 + (f"; {self.manual_points:g} more points are graded by hand" if self.manual_points else "")]
        if self.problem:
            lines.append(f"Not graded: {self.problem}")
        elif self.failure:
            lines.append(f"Grading stopped: {self.failure}")
        lost = [p for t in self.tests if not t.manual for p in t.parts if not p.passed]
        if lost and not self.problem:
            lines.append(f"{len(lost)} test(s) lost points; each test says why"
                         + (" (a hidden test's result may be shown only after the due date)."
                            if any(p.name == "hidden" for p in lost) else "."))
        return "\n".join(lines)

    def how(self) -> str:
        """How the grader ran (for the output and the log)."""
        return (f"graded by minidist's autograder: sandbox: {self.sandbox or 'not started'}; "
                f"confirmation run {'on' if self.confirmation else 'OFF'}")


def test_cells(lab: str, solutions: Path | None = None) -> list[Test]:
    """Every graded cell of the lab's source notebook(s), in order, at 0 points."""
    out = []
    for name in lab_notebooks(lab, solutions):
        nb = read_nb((solutions or solutions_dir()) / lab / f"{name}.ipynb")
        for c in nb.cells:
            m = nbg(c)
            if not m.get("grade"):
                continue
            manual = bool(m.get("solution")) or c.cell_type != "code"
            points = float(m.get("points") or 0)
            t = Test(name, grade_id(c), 0.0, points, "manual" if manual else "error",
                     "graded by hand" if manual else "not run", hidden=not manual and has_hidden(c.source),
                     manual=manual)
            if not manual:
                hidden = hidden_points(c, points)
                t.parts = [Part(part, 0.0, share, t.status, t.reason)
                           for part, share in (("visible", points - hidden), ("hidden", hidden))
                           if part == "visible" or hidden]
            out.append(t)
    return out


def notebooks_in(folder: Path) -> list[Path]:
    """The notebooks handed in (sub-folders too; no checkpoints, no macOS zip debris, no dot-folders)."""
    return sorted(p for p in Path(folder).rglob("*.ipynb")
                  if not any(part.startswith(".") or part == "__MACOSX" for part in p.relative_to(folder).parts))


def problem_with(folder: Path, lab: str) -> tuple[str | None, list[str]]:
    """(why the folder cannot be graded, or None; notes for the instructor)."""
    folder = Path(folder)
    wanted = [f"{n}.ipynb" for n in lab_notebooks(lab)]
    if not folder.is_dir():
        return f"no submission folder {folder}", []
    found = notebooks_in(folder)
    if not found:
        others = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        return (f"no notebook was handed in (found: {', '.join(others[:8]) or 'nothing'}); "
                f"upload {' and '.join(wanted)}"), []
    named = [p for p in found if p.name in wanted]
    if len(found) > len(wanted) and not named:
        return (f"{len(found)} notebooks were handed in ({', '.join(str(p.relative_to(folder)) for p in found[:8])}) "
                f"and none is named {' or '.join(wanted)}: upload only {' and '.join(wanted)}"), []
    extra = [str(p.relative_to(folder)) for p in found if p.name not in wanted] if named else []
    return None, ([f"notebooks handed in besides {', '.join(wanted)} (not graded): {', '.join(extra[:8])}"]
                  if extra else [])


def grade_folder(folder: Path, lab: str, work: Path, *, confirm: bool = True, sandbox: bool | None = None,
                 wall_s: float | None = None, hide: Path | None = None, student: str = "student") -> Outcome:
    """Grade the submission in ``folder`` with the one grading core (``work``: an empty scratch folder;
    ``hide``: a folder the sandbox must not show, e.g. the platform's results folder)."""
    from autograder.grading.batch import grade_one
    from autograder.grading.records import grader_fault

    t0 = time.time()
    if not lab_notebooks(lab):
        raise GraderFailure(f"no lab {lab} in the grader's course files ({solutions_dir()})")
    tests = test_cells(lab)
    problem, notes = problem_with(folder, lab)
    if problem:
        for t in tests:
            if not t.manual:
                t.reason = f"not graded: {problem}"
                for part in t.parts:
                    part.reason = t.reason
        return Outcome(lab, tests, problem=problem, notes=notes, sandbox="not started (nothing to grade)",
                       confirmation=confirm, seconds=time.time() - t0)
    job, batch = grade_one(folder, lab, work, student=student, confirm=confirm, sandbox=sandbox, wall_s=wall_s,
                           hide=hide)
    fault = grader_fault(job.result)
    if fault:
        raise GraderFailure(fault)
    rows = {(nb, cid): row for nb, cells in job.result["cells"].items() for cid, row in cells.items()}
    for t in tests:
        row = rows.get((t.notebook, t.name))
        if row is None:          # the core reports every test of the template: not expected
            t.reason = "no result from the grader for this test"
            continue
        t.status, t.reason = str(row["status"]), str(row.get("reason", ""))
        t.max_points = float(row["max_points"])
        t.points = 0.0 if t.manual else float(row["points"] or 0.0)
        t.flags = list(row.get("flags") or [])       # "not confirmed: tampering suspected" among them
        if t.manual:
            continue
        if row.get("parts"):
            t.parts = [Part(name, float(p["points"]), float(p["max_points"]), str(p["status"]), str(p["reason"]))
                       for name, p in row["parts"].items()]
        elif t.points in (0.0, t.max_points):     # not scored in parts (nothing ran; no confirmation): all or none
            for part in t.parts:
                part.points = part.max_points if t.points else 0.0
                part.status, part.reason = t.status, t.reason
        else:
            t.parts = [Part("visible", t.points, t.max_points, t.status, t.reason)]
    return Outcome(lab, tests, failure=job.result.get("failure"), notes=notes + list(job.result.get("notes", [])),
                   sandbox=batch.sandbox, confirmation=confirm, seconds=time.time() - t0)


def clear_results(path: Path) -> None:
    """Nothing at ``path`` (a file, a folder, a link a submission left), nor in place of its folder:
    what a platform finds when the grader failed (Gradescope: no results file, its own error)."""
    import shutil
    path = Path(path)
    folder = path.parent
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        folder.unlink()
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def report_failure(lab: str, err: BaseException, what_platform_shows: str, bundle_line: str) -> str:
    """Tell the instructor (on stdout: both platforms keep it for the course staff) that the grader
    failed and why, with the traceback of an unexpected exception; returns the cause in one line."""
    import sys
    import traceback
    why = str(err) if isinstance(err, GraderFailure) else f"{type(err).__name__}: {str(err)[:300]}"
    try:
        if not isinstance(err, GraderFailure):
            traceback.print_exc(file=sys.stdout)
        print(f"{lab}: THE GRADER FAILED (not the submission's fault): {why}\n"
              f"No score was recorded: {what_platform_shows}. Fix the cause, then regrade the submission.\n"
              f"{bundle_line}", flush=True)
    except OSError:
        pass
    return why


def write_last(path: Path, data: dict) -> Path:
    """``data`` as JSON at ``path``, written by the grader's own process once every process of the
    submission is gone (so nothing of the submission can write after it): whatever stands at the path,
    or in place of its folder, is removed first (a file, a folder, a link a submission left there), and
    the file is written under a fresh name, then renamed into place."""
    import json
    import os
    import tempfile
    path = Path(path)
    clear_results(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".results-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path
