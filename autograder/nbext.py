"""Small extensions of nbgrader preprocessors used by the autograder.

They extend nbgrader's own classes (no reimplementation of its grading logic):

* ``ProgressExecute`` = nbgrader's ``Execute`` + a progress log (one JSON line per
  cell started / finished) so that a submission whose kernel dies or that is killed
  at the wall-clock limit still gets per-test results for the cells that ran;
* ``HideHiddenTests`` = nbgrader's ``ClearHiddenTests`` for *feedback*: removes the
  hidden-test source and the traceback lines that would quote it, keeping the
  error name and message (pass/fail stays visible);
* ``TruncateOutput``: caps the size of each output (megabytes of output on one line
  slip past nbgrader's line-based ``LimitOutput``).
"""
from __future__ import annotations

import json
import time

from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor
from nbgrader.utils import determine_grade, is_grade
from traitlets import Integer, Unicode

from autograder.notebooks import classify

MAX_OUTPUT_CHARS = 20_000


def _trim(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n... [{len(text) - limit} characters cut by the autograder] ...\n" \
        + text[-limit // 2:]


class ProgressExecute(Execute):
    progress_file = Unicode("", help="append one JSON line per executed cell here").tag(config=True)

    def _log_progress(self, **rec):
        if not self.progress_file:
            return
        rec["t"] = time.time()
        with open(self.progress_file, "a") as f:
            f.write(json.dumps(rec) + "\n")

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
