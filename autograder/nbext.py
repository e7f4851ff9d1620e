"""Small extensions of nbgrader preprocessors used by the autograder.

They extend nbgrader's own classes (no reimplementation of its grading logic):

* ``ProgressExecute`` = nbgrader's ``Execute`` + a progress record per cell started /
  finished (with the points nbgrader's rules give a finished test cell, computed here in the
  grader's process from the kernel's reply), handed to ``PROGRESS_SINK``: the worker keeps
  them and sends them to the parent through a pipe, so a submission whose kernel dies or that
  is killed at the wall-clock limit still gets per-test results for the cells that ran, and
  nothing the kernel can write decides a score;
* ``HideHiddenTests`` = nbgrader's ``ClearHiddenTests`` for *feedback*: removes the
  hidden-test source and the traceback lines that would quote it, keeping the
  error name and message (pass/fail stays visible);
* ``TruncateOutput``: caps the size of each output (megabytes of output on one line
  slip past nbgrader's line-based ``LimitOutput``);
* ``LatePenalty`` = nbgrader's late-submission plugin with a ``per_day`` method.
"""
from __future__ import annotations

import time

from nbgrader.plugins import LateSubmissionPlugin
from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor
from nbgrader.utils import determine_grade, is_grade
from traitlets import Enum, Float, Integer

from autograder.notebooks import classify

MAX_OUTPUT_CHARS = 20_000


def _trim(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n... [{len(text) - limit} characters cut by the autograder] ...\n" \
        + text[-limit // 2:]


#: where ProgressExecute's records go (set by the worker): a callable taking one dict
PROGRESS_SINK = None


class ProgressExecute(Execute):

    def _log_progress(self, **rec):
        rec["t"] = time.time()
        if PROGRESS_SINK is not None:
            PROGRESS_SINK(rec)

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


class HideHiddenTests(ClearHiddenTests):
    """ClearHiddenTests for feedback: also hides tracebacks that quote hidden lines."""

    def preprocess_cell(self, cell, resources, cell_index):
        removed = self._remove_hidden_test_region(cell) if cell.cell_type == "code" else False
        if removed:
            cell.source = cell.source.rstrip("\n") + "\n# (hidden tests not shown)"
            for o in cell.get("outputs", []):
                if o.get("output_type") == "error":
                    o["traceback"] = [f"{o.get('ename', 'Error')}: {o.get('evalue', '')}"]
        return cell, resources


class TruncateOutput(NbGraderPreprocessor):
    max_chars = Integer(MAX_OUTPUT_CHARS, help="maximum characters per output").tag(config=True)

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
