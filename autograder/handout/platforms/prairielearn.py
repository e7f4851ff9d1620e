"""PrairieLearn: ``python -m autograder prairielearn LAB`` writes an external-grading question and
the grader image it names; the image's entry point grades ``/grade/student`` with the one grading
core (:mod:`autograder.handout.platforms.graded`) and writes ``/grade/results/results.json``.

``results.json``: ``succeeded`` (the grader ran), ``gradable`` (false when nothing could be graded:
no notebook, several notebooks none of them the lab's: PrairieLearn does not score the submission),
``score`` in [0, 1] (the automatic tests' points over their maximum),
``message`` (the summary), ``output`` (how it was graded and the notes), and ``tests``: ``name``,
``description``, ``points``, ``max_points``, ``message`` (the one-line reason and flags). A cell graded
by hand is listed with ``max_points`` 0: its points are the question's manual points.

Written last, by this process, once every process of the submission is gone
(:func:`~autograder.handout.platforms.graded.write_last`). The root (``/grade``) is
``$MINIDIST_PRAIRIELEARN_ROOT`` where set (the tests lay out a grading container in a folder).

A failure of the grader itself (it could not start, crashed, lacks the lab: not the submission's
fault) exits with status 1, the cause on stdout, and writes ``succeeded: false, gradable: false``
with a message. PrairieLearn's grader host reads results.json only from an entry point that exited
with 0; otherwise it marks the job failed, which PrairieLearn shows as "Grading failed!" and does not
score (the submission is not gradable: no points awarded or lost), and the container's output is
in the grading job's log, for the course staff. The results.json written is PrairieLearn's own form of
a grader error (``results: {succeeded: false, gradable: false}`` and a message), for a runner that
reads it all the same. Every run's stdout names the bundle (:mod:`autograder.handout.platforms.version`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from autograder.handout.platforms.graded import Outcome, grade_folder, report_failure, write_last
from autograder.handout.platforms.limits import PRAIRIELEARN_MAX, prairielearn_image, prairielearn_wall
from autograder.handout.platforms.version import describe, load_for_run, write_record

ROOT_VAR = "MINIDIST_PRAIRIELEARN_ROOT"
#: info.json's timeout (s), and the submission's wall-clock limit within it (setting up the batch and
#: writing the results take the rest)
TIMEOUT = PRAIRIELEARN_MAX
WALL = prairielearn_wall(TIMEOUT)
FAILED = 'PrairieLearn shows "Grading failed!" and does not score the submission'

ENTRY = r"""#!/usr/bin/env bash
# PrairieLearn's external grader runs this once per submission: grades /grade/student into
# /grade/results/results.json with minidist's autograder (see autograder/README.md, PrairieLearn).
ROOT="${@ROOT_VAR@:-/grade}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/course" || exit 1
export MINIDIST_SOLUTIONS="$HERE/course/solutions"
export MINIDIST_HIDDEN="$HERE/course/hidden"          # the hidden cases: the grader's, no job reads them
exec "${MINIDIST_VENV:-$HERE/venv}/bin/python" -m autograder.handout.platforms.prairielearn @LAB@ --root "$ROOT" @OPTS@
"""

DOCKERFILE = """# The grader image of PrairieLearn's question minidist/@LAB@: build and push it, name it in info.json.
FROM python:@PY@-slim
COPY . /minidist
RUN bash /minidist/setup.sh
"""

QUESTION = """<pl-question-panel>
  <p>Upload your completed notebook <code>@NB@</code> (the lab's notebook from the course's release).
  It is graded by the course's autograder: the tests of the notebook, hidden tests, and a second run
  of every test outside your notebook.</p>
</pl-question-panel>
<pl-file-upload file-names="@NB@"></pl-file-upload>
<pl-submission-panel>
  <pl-external-grader-results></pl-external-grader-results>
  <pl-file-preview></pl-file-preview>
</pl-submission-panel>
"""


def results_json(outcome: Outcome, succeeded: bool = True) -> dict:
    """PrairieLearn's results.json for one graded submission."""
    tests = []
    for t in outcome.tests:
        if t.manual:
            tests.append({"name": f"{t.notebook}: {t.name}", "description": "graded by hand",
                          "points": 0.0, "max_points": 0.0,
                          "message": f"graded by hand: {t.max_points:g} points, this question's manual points"})
            continue
        for part in t.parts:
            shown = part.name == "visible"
            tests.append({"name": f"{t.notebook}: {t.name}" + ("" if shown else " (hidden tests)"),
                          "description": "" if shown else "the grader's hidden cases",
                          "points": round(part.points, 6), "max_points": part.max_points,
                          "message": (part.reason + ("".join(f"\n{f}" for f in t.flags) if shown else "")).strip()
                          or part.status})
    mx = outcome.max_score
    return {"succeeded": succeeded, "gradable": succeeded and not outcome.problem,
            "score": min(1.0, max(0.0, outcome.score / mx)) if mx > 0 else 0.0,
            "message": outcome.summary(), "output": "\n".join([outcome.how()] + outcome.notes), "tests": tests}


def failed_json() -> dict:
    """results.json when the grader itself failed: PrairieLearn's own form of a grader error."""
    return {"succeeded": False, "gradable": False,
            "message": "Grading failed: the grader itself failed, not your submission. No score was recorded; "
                       "the course staff can see why in this grading job's output."}


def run(root: Path, lab: str, confirm: bool = True, wall_s: float | None = None,
        bundle: dict | None = None) -> dict | None:
    """Grade ``root/student`` and write ``root/results/results.json``; returns what was written, or None
    when the grader itself failed (results.json then holds :func:`failed_json`, and the entry point
    exits with 1). ``bundle``: the bundle's record (:mod:`autograder.handout.platforms.version`)."""
    t0 = time.time()
    results = root / "results"
    work = Path(tempfile.mkdtemp(prefix="minidist-prairielearn-"))
    try:
        outcome = grade_folder(root / "student", lab, work, confirm=confirm, wall_s=wall_s, hide=results)
    except BaseException as err:              # the grader's own failure: no score, the staff are told
        if isinstance(err, KeyboardInterrupt):
            raise
        write_last(results / "results.json", failed_json())
        report_failure(lab, err, FAILED, describe(bundle))
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    outcome.seconds = time.time() - t0
    data = results_json(outcome)
    write_last(results / "results.json", data)
    try:
        print(describe(bundle) + "\n" + data["message"] + "\n" + data["output"])
    except OSError:
        pass
    return data


def build(lab: str, out: Path, image: str | None, timeout: int = TIMEOUT) -> Path:
    """``out/LAB_prairielearn/``: ``questions/minidist/LAB/`` (info.json, question.html) for the
    course repository, ``grader-image/`` (the bundle, its record ``bundle.json``, the entry point, a
    Dockerfile) for the image. ``image``: the name it is pushed under (required); ``timeout``: info.json's
    (at most PrairieLearn's 600 s; the submission's wall-clock limit is 60 s less)."""
    from autograder.course.labs import lab_notebooks
    from autograder.handout.platforms.bundle import make_bundle
    image, wall = prairielearn_image(image), prairielearn_wall(timeout)
    dest = Path(out) / f"{lab}_prairielearn"
    shutil.rmtree(dest, ignore_errors=True)
    tree = make_bundle(lab, dest / "grader-image")
    write_record(lab, tree)
    entry = tree / "run_prairielearn"
    opts = f'--wall-timeout {wall:g} --bundle "$HERE/bundle.json"'
    entry.write_text(ENTRY.replace("@ROOT_VAR@", ROOT_VAR).replace("@LAB@", lab).replace("@OPTS@", opts))
    entry.chmod(0o755)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    (tree / "Dockerfile").write_text(DOCKERFILE.replace("@LAB@", lab).replace("@PY@", py))
    q = dest / "questions" / "minidist" / lab
    q.mkdir(parents=True)
    names = [f"{n}.ipynb" for n in lab_notebooks(lab)]
    info = {"uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"minidist/{lab}")), "title": f"minidist: {lab}",
            "topic": "Distributed training", "tags": ["minidist", "notebook"], "type": "v3",
            "singleVariant": True, "gradingMethod": "External",
            "externalGradingOptions": {"enabled": True, "image": image,
                                       "entrypoint": "/minidist/run_prairielearn", "timeout": timeout}}
    (q / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    (q / "question.html").write_text(QUESTION.replace("@NB@", " ".join(names)))
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.handout.platforms.prairielearn",
                                description="grade a PrairieLearn submission (the grader image's entry point)")
    p.add_argument("lab")
    p.add_argument("--root", default=os.environ.get(ROOT_VAR) or "/grade")
    p.add_argument("--wall-timeout", type=float, default=WALL, help="the submission's wall-clock limit (s)")
    p.add_argument("--bundle", help="the bundle's record (bundle.json), named in the output")
    a = p.parse_args(argv)
    data = run(Path(a.root), a.lab, wall_s=a.wall_timeout, bundle=load_for_run(a.bundle))
    return 0 if data is not None else 1


if __name__ == "__main__":
    sys.exit(main())
