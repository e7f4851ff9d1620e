"""The platforms' time limits, checked when a bundle is built (a wrong one fails there, with the
reason, not later on the platform with every submission killed).

A platform kills the grading job at its timeout; the grader must have written its results before
then. So a submission's wall-clock limit (the core's, :func:`autograder.grading.batch.grade_one`) is the
platform's timeout less ``MARGIN`` (setting up the batch, building its template course, writing the
results), and it must leave at least ``MIN_GRADING`` seconds to grade in.

* PrairieLearn: ``externalGradingOptions.timeout`` in ``info.json`` may not exceed 600 s (its
  documentation, "External Grading": "This value cannot exceed 600 seconds"); the wall-clock limit is
  ``timeout - MARGIN``.
* Gradescope: the timeout is set in the assignment's autograder settings (10 minutes unless changed);
  the wall-clock limit (``--wall-timeout``) is at most that less ``MARGIN``.
"""
from __future__ import annotations

import re

#: seconds a platform's timeout keeps beyond the submission's wall-clock limit
MARGIN = 60
#: the least wall-clock limit a bundle may give a submission (the solutions of the course's labs
#: grade in 20 to 65 s on one CPU: autograder/README.md, "Resources to request")
MIN_GRADING = 60
PRAIRIELEARN_MAX = 600
GRADESCOPE_DEFAULT = 600

#: a Docker image reference: [host[:port]/]path[:tag][@digest], the path in lower case
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(rf"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
                   r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")


def prairielearn_wall(timeout) -> int:
    """The submission's wall-clock limit for info.json's ``timeout`` (s), or a clear error."""
    if isinstance(timeout, bool) or not isinstance(timeout, int):
        raise SystemExit(f"--timeout {timeout!r}: a whole number of seconds")
    if timeout > PRAIRIELEARN_MAX:
        raise SystemExit(f"--timeout {timeout}: PrairieLearn's external grading timeout is at most "
                         f"{PRAIRIELEARN_MAX} s")
    if timeout - MARGIN < MIN_GRADING:
        raise SystemExit(f"--timeout {timeout}: too short; a submission gets the timeout less {MARGIN} s "
                         f"(the batch's setup and the results), and it needs at least {MIN_GRADING} s: "
                         f"use {MIN_GRADING + MARGIN} to {PRAIRIELEARN_MAX}")
    return timeout - MARGIN


def prairielearn_image(image) -> str:
    """The grader image's name for info.json: required (no default can name the course's registry)."""
    if not image:
        raise SystemExit("--image is required: the name the grader image is pushed under and PrairieLearn "
                         "pulls, e.g. --image yourorg/minidist-grader-lab1 (build and push it from grader-image/)")
    if not IMAGE.match(image):
        raise SystemExit(f"--image {image!r}: not a Docker image name ([registry/]name[:tag], the name in "
                         f"lower case, e.g. yourorg/minidist-grader-lab1:2026)")
    return image


def gradescope_wall(wall_s=None, timeout=GRADESCOPE_DEFAULT) -> float:
    """The submission's wall-clock limit within Gradescope's ``timeout`` (both s): ``wall_s`` checked,
    or ``timeout - MARGIN`` when not given."""
    if not (isinstance(timeout, (int, float)) and timeout == timeout) or timeout - MARGIN < MIN_GRADING:
        raise SystemExit(f"--timeout {timeout!r}: Gradescope's timeout must leave a submission at least "
                         f"{MIN_GRADING} s after {MARGIN} s for the batch's setup and the results: "
                         f"at least {MIN_GRADING + MARGIN} s")
    if wall_s is None:
        return float(timeout - MARGIN)
    if not (isinstance(wall_s, (int, float)) and wall_s == wall_s) or wall_s < MIN_GRADING:
        raise SystemExit(f"--wall-timeout {wall_s!r}: a submission needs at least {MIN_GRADING} s")
    if wall_s > timeout - MARGIN:
        raise SystemExit(f"--wall-timeout {wall_s:g}: must be at most Gradescope's timeout less {MARGIN} s "
                         f"({timeout:g} - {MARGIN} = {timeout - MARGIN:g}), so that the results are written "
                         f"before Gradescope stops the run; raise the assignment's timeout and pass it as "
                         f"--timeout")
    return float(wall_s)
