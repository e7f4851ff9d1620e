"""Small extensions of nbgrader preprocessors used by the autograder.

They extend nbgrader's own classes (no reimplementation of its grading logic):

* ``ProgressExecute`` = nbgrader's ``Execute`` + a progress record per cell started /
  finished (with the points nbgrader's rules give a finished test cell, computed here in the
  grader's process from the kernel's reply), handed to its ``sink`` (:func:`with_sink`): the worker keeps
  them and sends them to the parent through a pipe, so a submission whose kernel dies or that
  is killed at the wall-clock limit still gets per-test results for the cells that ran, and
  nothing the kernel can write decides a score;
* ``HideHiddenTests``, for *feedback*: a test cell (recognised by its cell id, never by what its
  source says) shows the release's source, so its hidden tests are gone whatever the student
  wrote elsewhere, and its tracebacks (which could quote them) become the error's name and
  message (pass/fail stays visible);
* ``TruncateOutput``: caps the size of each output (megabytes of output on one line slip past
  nbgrader's line-based ``LimitOutput``), and the outputs of a whole notebook, in bytes and in
  number: past the cap, the outputs of the student's own cells are replaced by one note (a
  test cell's outputs are its verdict: always kept, each trimmed);
* ``LatePenalty`` = nbgrader's late-submission plugin with a ``per_day`` method;
* ``SkipDemoCells``, for plain ``nbgrader autograde`` (the course config enables it): the cells a lab
  tags ``demo`` are blanked before the notebook runs, as ``python -m autograder grade`` does
  (:func:`autograder.course.cells.skip_demos`).
"""
from __future__ import annotations

import time

import nbformat
from nbgrader.plugins import LateSubmissionPlugin
from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor
from nbgrader.utils import determine_grade, is_grade
from traitlets import Enum, Float, Integer

from autograder.course.cells import skip_demos
from autograder.grading.worker.notebooks import classify

MAX_OUTPUT_CHARS = 20_000
MAX_NOTEBOOK_OUTPUT_CHARS = 2_000_000      # all outputs of one notebook
MAX_NOTEBOOK_OUTPUTS = 1_000


def _trim(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n... [{len(text) - limit} characters cut by the autograder] ...\n" \
        + text[-limit // 2:]


class ProgressExecute(Execute):
    #: where the records go: a callable taking one dict (a job's subclass sets it, :func:`with_sink`)
    sink = None

    def _log_progress(self, **rec):
        rec["t"] = time.time()
        if self.sink is not None:
            self.sink(rec)

    def on_cell_start(self, cell=None, cell_index=None, **_):
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        self._log_progress(event="start", index=cell_index, grade_id=gid)

    def on_cell_executed(self, cell=None, cell_index=None, execute_reply=None, **kw):
        super().on_cell_executed(cell=cell, cell_index=cell_index, execute_reply=execute_reply, **kw)
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        rec = dict(event="done", index=cell_index, grade_id=gid)
        if gid and is_grade(cell) and cell.cell_type == "code":
            points, max_points = determine_grade(cell)
            status, reason = classify(cell, points, max_points, self.timeout or 0)
            rec.update(points=points, max_points=max_points, status=status, reason=reason)
        self._log_progress(**rec)


def with_sink(sink) -> type:
    """``ProgressExecute`` for one run of nbgrader, its records going to ``sink``."""
    return type("JobProgressExecute", (ProgressExecute,), {"sink": staticmethod(sink)})


class HideHiddenTests(ClearHiddenTests):
    """Feedback without hidden tests: a test cell's source is the release's (by cell id), and its
    tracebacks are cut to the error's name and message (a job's subclass holds the release's test
    cells, :func:`hiding`)."""
    #: {grade_id: source} of the release's test cells (hidden tests stripped)
    release_tests: dict = {}

    def preprocess_cell(self, cell, resources, cell_index):
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        release = self.release_tests
        before = cell.get("source", "")
        if cell.cell_type == "code" and gid in release:
            if cell.source != release[gid]:
                cell.source = release[gid].rstrip("\n") + "\n# (hidden tests not shown)"
        elif cell.cell_type == "code" and is_grade(cell):       # no release at hand: nbgrader's markers
            if self._remove_hidden_test_region(cell):
                cell.source = cell.source.rstrip("\n") + "\n# (hidden tests not shown)"
        if cell.source != before:
            _cut_hidden(cell, hidden_lines(before, cell.source))
        return cell, resources


def hidden_lines(full: str, shown: str) -> set[str]:
    """The lines of a test cell's source that its shown source leaves out (its hidden tests), those long
    enough to say something (a lone bracket is in every traceback)."""
    kept = {l.strip() for l in shown.splitlines()}
    return {l.strip() for l in full.splitlines() if len(l.strip()) >= 8 and l.strip() not in kept}


def _cut_hidden(cell, hidden: set[str]) -> None:
    """A test cell's tracebacks become the error's name and message, and no output quotes a hidden
    line: nbclient's timeout error previews the cell's source in its message."""
    def scrub(text: str) -> str:
        text = text.split("Here is a preview of the cell contents")[0]
        return "\n".join("(a hidden test's line)" if any(h in l for h in hidden) else l
                         for l in text.split("\n"))
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            o["evalue"] = scrub(o.get("evalue", ""))
            o["traceback"] = [f"{o.get('ename', 'Error')}: {o['evalue']}"]
        elif o.get("output_type") == "stream":
            o["text"] = scrub(o.get("text", ""))


def hiding(release_tests: dict) -> type:
    """``HideHiddenTests`` for one job's feedback, with that lab's release test cells."""
    return type("JobHideHiddenTests", (HideHiddenTests,), {"release_tests": dict(release_tests)})


def _size(o) -> int:
    if o.get("output_type") == "stream":
        return len(o.get("text", ""))
    if o.get("output_type") == "error":
        return sum(len(t) for t in o.get("traceback", [])) + len(o.get("evalue", ""))
    return sum(len(v) if isinstance(v, str) else len(str(v)) for v in (o.get("data") or {}).values())


class TruncateOutput(NbGraderPreprocessor):
    max_chars = Integer(MAX_OUTPUT_CHARS, help="maximum characters per output").tag(config=True)
    max_notebook_chars = Integer(MAX_NOTEBOOK_OUTPUT_CHARS, help="maximum characters of all outputs").tag(config=True)
    max_notebook_outputs = Integer(MAX_NOTEBOOK_OUTPUTS, help="maximum number of outputs").tag(config=True)

    def preprocess(self, nb, resources):
        nb, resources = super().preprocess(nb, resources)
        chars = count = 0
        for cell in nb.cells:
            outputs = cell.get("outputs", []) or []
            if is_grade(cell):                                 # a test's verdict: kept, counted
                chars += sum(_size(o) for o in outputs)
                count += len(outputs)
                continue
            kept = []
            for k, o in enumerate(outputs):
                if chars + _size(o) > self.max_notebook_chars or count + 1 > self.max_notebook_outputs:
                    rest = outputs[k:]
                    kept.append({"output_type": "stream", "name": "stdout",
                                 "text": f"[{len(rest)} more outputs ({sum(_size(r) for r in rest)} characters) cut by "
                                         f"the autograder: a notebook shows at most {self.max_notebook_outputs} "
                                         f"outputs and {self.max_notebook_chars} characters]\n"})
                    break
                chars += _size(o)
                count += 1
                kept.append(o)
            if len(kept) != len(outputs):
                cell.outputs = [nbformat.from_dict(o) for o in kept]
        return nb, resources

    def preprocess_cell(self, cell, resources, cell_index):
        for o in cell.get("outputs", []) or []:
            if o.get("output_type") == "stream":
                o["text"] = _trim(o.get("text", ""), self.max_chars)
            elif o.get("output_type") == "error":
                tb = "\n".join(o.get("traceback", []))
                if len(tb) > self.max_chars:
                    o["traceback"] = _trim(tb, self.max_chars).split("\n")
            elif "data" in o:
                for k, v in list(o["data"].items()):
                    if isinstance(v, str) and len(v) > self.max_chars:
                        o["data"][k] = _trim(v, self.max_chars)
        return cell, resources


class LatePenalty(LateSubmissionPlugin):
    """nbgrader's late-submission plugin with one more method, ``per_day``: a fraction of the
    score per started day late (``per_day``), at most ``max_fraction`` of it. Configured in
    ``nbgrader_config.py`` (``c.LatePenalty.penalty_method``)."""

    penalty_method = Enum(("none", "zero", "per_day"), default_value="none",
                          help="'none', 'zero' (nbgrader's), or 'per_day'").tag(config=True)
    per_day = Float(0.1, help="fraction of the score lost per started day late").tag(config=True)
    max_fraction = Float(1.0, help="the most a late submission can lose, as a fraction").tag(config=True)

    def late_submission_penalty(self, student_id, score, total_seconds_late):
        if self.penalty_method != "per_day":
            return super().late_submission_penalty(student_id, score, total_seconds_late)
        if not total_seconds_late or total_seconds_late <= 0 or not score:
            return None
        days = -(-float(total_seconds_late) // 86400)          # started days
        return min(self.max_fraction, self.per_day * days) * float(score)


class SkipDemoCells(NbGraderPreprocessor):
    """Blank the cells tagged ``demo`` (a deadlock demonstration, a benchmark): they grade nothing and
    would add seconds, or a deadlock's timeout, to every notebook graded."""

    def preprocess(self, nb, resources):
        return skip_demos(nb), resources
