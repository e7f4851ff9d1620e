"""Gradescope: ``python -m autograder gradescope LAB`` builds ``LAB_autograder.zip``; Gradescope runs
its ``setup.sh`` once (:mod:`autograder.handout.platforms.bundle`) and its ``run_autograder`` per submission.

``run_autograder`` grades the notebook in ``/autograder/submission`` with the one grading core
(:mod:`autograder.handout.platforms.graded`) and writes ``/autograder/results/results.json`` in Gradescope's
format: ``score``, ``execution_time``, ``output`` (the summary and how it was graded: the sandbox or
why there is none, the confirmation), and ``tests``, one per test cell: ``name`` (its grade id),
``score``, ``max_score``, ``status`` (``passed`` / ``failed``), ``output`` (the one-line reason and
flags) and ``visibility``. A test cell with hidden tests is two tests, its visible part (``visible``)
and its hidden part (``after_due_date``), each with its share of the cell's points
(:mod:`autograder.course.hidden_tests`); both visibilities are configurable when the zip is built. A
cell graded by hand is listed with ``max_score`` 0 and says so: its points belong to a manual question on Gradescope.

The file is written last, by this process, once every process of the submission has been killed
(:func:`~autograder.handout.platforms.graded.write_last`): what a submission writes there has no effect.
A failure of the grader itself (it could not start, crashed, lacks the lab: not the submission's
fault) leaves no results.json and exits with status 1, with the cause on stdout: Gradescope then
shows the submission as "The autograder failed to execute correctly", with no score, and keeps the
stdout for the instructor (its "Autograder Specifications": ``/autograder/results/stdout`` is
displayed back to the instructor; results.json "must be produced" by ``run_autograder``).
Every run's stdout names the bundle (:mod:`autograder.handout.platforms.version`), as does results.json's
``extra_data``. The root (``/autograder``) is ``$MINIDIST_GRADESCOPE_ROOT`` where set (the tests lay
out a Gradescope machine in a folder).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from autograder.handout.platforms.graded import Outcome, clear_results, grade_folder, report_failure, write_last
from autograder.handout.platforms.limits import GRADESCOPE_DEFAULT, MARGIN, gradescope_wall
from autograder.handout.platforms.version import describe, load_for_run, write_record

ROOT_VAR = "MINIDIST_GRADESCOPE_ROOT"
VISIBILITIES = ("visible", "after_due_date", "after_published", "hidden")
#: the submission's wall-clock limit (s): Gradescope's default timeout is 10 minutes, and setting up
#: the batch and writing the results take some of them
WALL = GRADESCOPE_DEFAULT - MARGIN
FAILED = 'Gradescope shows the submission as "The autograder failed to execute correctly", without a score'

RUN = r"""#!/usr/bin/env bash
# Gradescope runs this once per submission: grades /autograder/submission into
# /autograder/results/results.json with minidist's autograder (see autograder/README.md, Gradescope).
ROOT="${@ROOT_VAR@:-/autograder}"
HERE="$ROOT/source"
cd "$HERE/course" || exit 1
export MINIDIST_SOLUTIONS="$HERE/course/solutions"
export MINIDIST_HIDDEN="$HERE/course/hidden"          # the hidden cases: the grader's, no job reads them
exec "${MINIDIST_VENV:-$HERE/venv}/bin/python" -m autograder.handout.platforms.gradescope @LAB@ --root "$ROOT" @OPTS@
"""


def results_json(outcome: Outcome, hidden: str = "after_due_date", visible: str = "visible") -> dict:
    """Gradescope's results.json for one graded submission."""
    tests = []
    for t in outcome.tests:
        if t.manual:
            tests.append({"name": f"{t.notebook}: {t.name} (graded by hand)", "score": 0.0, "max_score": 0.0,
                          "output": f"graded by hand: {t.max_points:g} points, in this assignment's manual "
                                    f"grading, not by the autograder", "visibility": "visible"})
            continue
        for part in t.parts:          # the visible tests shown at once, the hidden ones as configured
            shown = part.name == "visible"
            out = part.reason + ("".join(f"\n{f}" for f in t.flags) if shown else "")
            tests.append({"name": f"{t.notebook}: {t.name}" + ("" if shown else " (hidden tests)"),
                          "score": round(part.points, 6), "max_score": part.max_points,
                          "status": "passed" if part.passed else "failed", "output": out.strip() or part.status,
                          "visibility": visible if shown else hidden})
    return {"score": round(outcome.score, 6), "execution_time": int(round(outcome.seconds)),
            "output": outcome.summary() + "\n\n" + outcome.how(), "tests": tests}


def run(root: Path, lab: str, hidden: str = "after_due_date", visible: str = "visible", confirm: bool = True,
        wall_s: float | None = None, bundle: dict | None = None) -> dict | None:
    """Grade ``root/submission`` and write ``root/results/results.json``; returns what was written, or
    None when the grader itself failed (then there is no results.json: Gradescope's own error state).
    ``bundle``: the bundle's record (:mod:`autograder.handout.platforms.version`), named in the output."""
    t0 = time.time()
    results = root / "results"
    work = Path(tempfile.mkdtemp(prefix="minidist-gradescope-"))
    try:
        outcome = grade_folder(root / "submission", lab, work, confirm=confirm, wall_s=wall_s, hide=results)
    except BaseException as err:              # the grader's own failure: no score, the instructor is told
        if isinstance(err, KeyboardInterrupt):
            raise
        clear_results(results / "results.json")
        report_failure(lab, err, FAILED, describe(bundle))
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    outcome.seconds = time.time() - t0
    data = results_json(outcome, hidden, visible)
    if bundle:
        data["extra_data"] = {"bundle": {k: bundle.get(k) for k in ("lab", "fingerprint", "built", "commit")}}
    write_last(results / "results.json", data)
    try:                                      # Gradescope keeps stdout for the instructor
        print(describe(bundle))
        print(data["output"])
        for t in outcome.tests:
            print(f"  {t.notebook}: {t.name}: {t.points:g}/{t.max_points:g} {t.status} {t.reason}")
        for n in outcome.notes:
            print(f"  note: {n}")
    except OSError:
        pass
    return data


def build(lab: str, out: Path, hidden: str = "after_due_date", visible: str = "visible", wall_s: float | None = None,
          timeout: float = GRADESCOPE_DEFAULT) -> Path:
    """``out/LAB_autograder.zip``: the bundle, its record (``bundle.json``), ``run_autograder``, all at
    the zip's root. ``timeout``: the assignment's Gradescope timeout (s); ``wall_s``: the submission's
    wall-clock limit in ``run_autograder``, at most ``timeout`` less :data:`~autograder.handout.platforms.limits.MARGIN`
    so that the results are written before Gradescope stops the run (default: exactly that)."""
    from autograder.handout.platforms.bundle import make_bundle
    wall_s = gradescope_wall(wall_s, timeout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="minidist-gradescope-zip-") as tmp:
        tree = make_bundle(lab, Path(tmp) / "zip")
        write_record(lab, tree)
        opts = (f"--hidden-visibility {hidden} --visible-visibility {visible} --wall-timeout {wall_s:g} "
                f'--bundle "$HERE/bundle.json"')
        script = tree / "run_autograder"
        script.write_text(RUN.replace("@ROOT_VAR@", ROOT_VAR).replace("@LAB@", lab).replace("@OPTS@", opts))
        script.chmod(0o755)
        dest = out / f"{lab}_autograder.zip"
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(tree.rglob("*")):
                if path.is_file():
                    info = zipfile.ZipInfo.from_file(path, str(path.relative_to(tree)))
                    info.compress_type = zipfile.ZIP_DEFLATED
                    z.writestr(info, path.read_bytes())      # keeps the mode: setup.sh, run_autograder exec
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.handout.platforms.gradescope",
                                description="grade a Gradescope submission (what run_autograder runs)")
    p.add_argument("lab")
    p.add_argument("--root", default=os.environ.get(ROOT_VAR) or "/autograder")
    p.add_argument("--hidden-visibility", choices=VISIBILITIES, default="after_due_date")
    p.add_argument("--visible-visibility", choices=VISIBILITIES, default="visible")
    p.add_argument("--wall-timeout", type=float, default=WALL, help="the submission's wall-clock limit (s)")
    p.add_argument("--bundle", help="the bundle's record (bundle.json), named in the output")
    a = p.parse_args(argv)
    data = run(Path(a.root), a.lab, a.hidden_visibility, a.visible_visibility, wall_s=a.wall_timeout,
               bundle=load_for_run(a.bundle))
    return 0 if data is not None else 1


if __name__ == "__main__":
    sys.exit(main())
