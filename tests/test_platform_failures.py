"""A failure of the grader itself is reported as each platform reports errors, never as a score; a
submission that is the student's problem keeps its score of 0 with the reason.

Gradescope: no results.json (its "The autograder failed to execute correctly", no score), exit
status 1, the cause on stdout (the instructor's). PrairieLearn: exit status 1 (its grader host then
marks the job failed: "Grading failed!", not gradable) and results.json ``succeeded: false,
gradable: false`` with a message. The failures are faked in the core (its batch, its supervisor or
its entry point raising), so nothing is graded here; the platforms' end-to-end runs, with a bundle
that lacks its lab, are in tests/test_platforms.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from autograder.grading import batch as core
from autograder.grading.records import KERNEL_NOT_STARTED, grader_fault
from autograder.grading.worker.autograde import failure_reason
from autograder.handout.platforms import gradescope, prairielearn, version
from autograder.handout.platforms.graded import GraderFailure, grade_folder
from autograder_fixtures import LAB, SOLUTIONS

PLATFORMS = {"gradescope": (gradescope, "submission"), "prairielearn": (prairielearn, "student")}


@pytest.fixture(autouse=True)
def fixture_course(monkeypatch):
    monkeypatch.setenv("MINIDIST_SOLUTIONS", str(SOLUTIONS))


def lay_out(tmp_path: Path, kind: str, files: dict | None = None) -> Path:
    """A platform's root: the submission (the lab's notebook unless ``files``), and a results.json that
    a submission left there (it must not stand once the grader failed)."""
    root = tmp_path / kind
    sub = root / PLATFORMS[kind][1]
    sub.mkdir(parents=True)
    if files is None:
        files = {f"{LAB}.ipynb": (SOLUTIONS / LAB / f"{LAB}.ipynb").read_bytes()}
    for name, data in files.items():
        (sub / name).write_bytes(data)
    (root / "results").mkdir()
    (root / "results" / "results.json").write_text(json.dumps({"score": 1000, "gradable": True}))
    return root


def core_raises(monkeypatch, where: str):
    """Make the core fail: its batch (``open_batch``, e.g. no sandbox can start) or, inside
    ``grade_submission``, its supervisor (``run_job``: the core catches it and marks the result)."""
    def boom(*a, **k):
        raise RuntimeError(f"{where} exploded")
    if where == "open_batch":
        monkeypatch.setattr(core, "open_batch", boom)
        return
    batch = core.Batch(work=Path("."), info={"sandbox": None, "sandbox_text": "faked"}, template=None, env={},
                       cell_timeout=10, wall=60)
    monkeypatch.setattr(core, "open_batch", lambda *a, **k: batch)
    monkeypatch.setattr(core, "close_batch", lambda b: None)
    monkeypatch.setattr(core, "lab_cells", lambda template, lab: {
        LAB: [{"name": "test_add", "max_score": 1.0, "kind": "test"},
              {"name": "test_allsum", "max_score": 2.0, "kind": "test"}]})
    monkeypatch.setattr(core, "run_job", boom)


@pytest.mark.parametrize("where", ["open_batch", "run_job"])
def test_gradescope_grader_failure_has_no_results_and_tells_the_instructor(tmp_path, monkeypatch, capsys, where):
    core_raises(monkeypatch, where)
    root = lay_out(tmp_path, "gradescope")
    rec = version.record(LAB)
    assert gradescope.run(root, LAB, bundle=rec) is None
    assert not (root / "results" / "results.json").exists()          # the submission's own file is gone too
    out = capsys.readouterr().out
    assert f"{LAB}: THE GRADER FAILED (not the submission's fault): " in out and f"{where} exploded" in out
    assert "The autograder failed to execute correctly" in out and "No score was recorded" in out
    assert f"fingerprint {rec['fingerprint'][:12]}" in out
    if where == "open_batch":            # an unexpected exception: its traceback, for whoever fixes it
        assert "Traceback (most recent call last)" in out
    else:                                # caught by the core, reported as its result: marked the grader's
        assert "grading failed: RuntimeError: run_job exploded" in out
    assert gradescope.main([LAB, "--root", str(root)]) == 1


@pytest.mark.parametrize("where", ["open_batch", "run_job"])
def test_prairielearn_grader_failure_is_not_gradable_and_exits_1(tmp_path, monkeypatch, capsys, where):
    core_raises(monkeypatch, where)
    root = lay_out(tmp_path, "prairielearn")
    assert prairielearn.run(root, LAB) is None
    data = json.loads((root / "results" / "results.json").read_text())
    assert data == prairielearn.failed_json()
    assert data["succeeded"] is False and data["gradable"] is False and "score" not in data
    assert "not your submission" in data["message"]
    out = capsys.readouterr().out
    assert "THE GRADER FAILED" in out and f"{where} exploded" in out and "Grading failed!" in out
    assert "bundle: no record" in out
    assert prairielearn.main([LAB, "--root", str(root)]) == 1


def test_a_lab_the_bundle_lacks_is_the_graders_failure(tmp_path, capsys):
    for kind, (platform, _) in PLATFORMS.items():
        root = lay_out(tmp_path, kind)
        assert platform.run(root, "lab99_missing") is None
        assert f"no lab lab99_missing in the grader's course files ({SOLUTIONS})" in capsys.readouterr().out
        with pytest.raises(GraderFailure, match="no lab lab99_missing"):
            grade_folder(root / PLATFORMS[kind][1], "lab99_missing", tmp_path / "work")


def test_the_students_problems_are_still_graded_zero(tmp_path, monkeypatch):
    """No notebook, or several none of them the lab's: the student's problem (the core is never reached:
    it raises here, and the results are written all the same)."""
    core_raises(monkeypatch, "open_batch")
    nb = nbformat.writes(nbformat.read(str(SOLUTIONS / LAB / f"{LAB}.ipynb"), as_version=4)).encode()
    root = lay_out(tmp_path, "gradescope", {"answer.py": b"def add(a, b):\n    return a + b\n"})
    data = gradescope.run(root, LAB)
    assert data["score"] == 0 and len(data["tests"]) == 4     # each test cell's visible and hidden parts
    assert "no notebook was handed in (found: answer.py)" in data["output"]
    assert json.loads((root / "results" / "results.json").read_text()) == data
    root = lay_out(tmp_path, "prairielearn", {"a.ipynb": nb, "b.ipynb": nb})
    data = prairielearn.run(root, LAB)
    assert data["succeeded"] is True and data["gradable"] is False
    assert "2 notebooks were handed in" in data["message"]


def test_which_failures_are_the_graders():
    kernel = failure_reason("DeadKernelError: kernel died", [], ["sandbox: could not mount /proc"])
    assert kernel.startswith(KERNEL_NOT_STARTED) and grader_fault({"failure": kernel}) == kernel
    assert grader_fault({"failure": "grading failed: worker exited with code -9", "grader_failed": True})
    started = [{"event": "start", "index": 0, "grade_id": "add"}]
    assert grader_fault({"failure": failure_reason("kernel died", started)}) is None      # the submission's
    assert grader_fault({"failure": "submission exceeded the 60 s wall-clock limit; killed",
                         "grader_failed": False}) is None
    assert grader_fault({"failure": None, "graded": True}) is None
