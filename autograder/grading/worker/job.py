"""Grade ONE submission in a private course directory: the worker's job, as its list of steps.

Run in the worker process (:mod:`.process`), under the supervisor's wall-clock limit; everything it
starts is killed afterwards. Nothing a kernel can write (files in the job folder, the per-job
gradebook) decides a score: notebook points are computed here, from the kernel's replies, as each
cell finishes; confirmed points come from the confirmation run (:mod:`autograder.confirm`).

:func:`run` is the steps, in order:

1. the job's course, copied from the batch's template (:class:`.submission.JobCourse`);
2. what was handed in: the notebook(s) found, parsed, flagged from their source, repaired, and the
   files next to them copied (:func:`.submission.take_in`);
3. the job's box: the sandbox's home, the kernel nbgrader drives in it (:class:`.box.Box`);
4. the confirmation runs, started at once (they need nothing of nbgrader's), their points reported to
   the supervisor as soon as they are known (:func:`autograder.confirm.points.report_points`);
5. ``nbgrader autograde``, the tests scored from the progress records, a timed-out test run once more
   (:func:`.autograde.autograde`);
6. the confirmation's points combined with the notebook's, a test it did not confirm run once more,
   alone (:func:`autograder.confirm.points.confirm_cells`);
7. the final scores into the job's gradebook, with the late penalties
   (:func:`autograder.grading.gradebook.record_scores`);
8. nbgrader's feedback, without hidden tests (:func:`.autograde.generate_feedback`).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from autograder.confirm.points import confirm_cells, report_points
from autograder.grading.gradebook import record_scores
from autograder.grading.worker.autograde import autograde, generate_feedback
from autograder.grading.worker.box import Box
from autograder.grading.worker.submission import JobCourse, take_in


def run(spec: dict, send=lambda msg: None) -> dict:
    """The job ``spec`` describes (the supervisor's: the submission, the template course, the limits, the
    batch's sandbox); its result, which the supervisor checks (:func:`autograder.grading.records.checked_result`).
    ``send``: a message to the supervisor (progress records, the confirmation's points)."""
    deadline = time.time() + float(spec.get("wall", 600)) - 5
    course = JobCourse.from_template(spec)                                   # 1
    handed = take_in(course, Path(spec["submission_dir"]))                   # 2
    box = Box(spec, course, handed, deadline)                                # 3
    confirming = spec.get("confirm", True)
    runs = {n: box.confirmation(n) for n in handed.notebooks} if confirming else {}     # 4
    if runs:      # the grader hears the confirmed points even if this worker never finishes
        threading.Thread(target=report_points, args=(runs, course.cells_meta, send), daemon=True).start()
    result = autograde(course, handed, box.kernel, spec, deadline, send)    # 5
    result["confirmation"] = (confirm_cells(result["cells"], runs, box.confirmation, deadline, course.cells_meta)
                              if confirming else {"ran": False})            # 6
    if result["graded"]:
        record_scores(course.root, course.lab, course.student, result)      # 7
        generate_feedback(course, result)                                   # 8
    box.remove()
    return result
