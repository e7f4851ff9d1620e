"""A grader started as root, with the course kept in a private folder (issue 47).

Courses are commonly kept in ``/root`` or a ``mktemp -d`` folder (0700) on a grading server, and
the grader drops every job to an unprivileged uid of its own. Here the checkout (with its virtual
environment) sits in a 0700 folder (made so in a private mount namespace, every path unchanged),
the submissions and the output in another, and the grader runs under a 0077 umask. With each sandbox backend
installed: the honest solution scores full marks, a helper module handed in next to the notebook
works in both runs (confirmed, full marks), and the root attack is refused. And where a job's uid
cannot reach the interpreter at all, the grader stops before the first job with one message.
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from autograder import REPO

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare (a private mount namespace)")


def _backends():
    return [name for name in ("bwrap", "unshare") if shutil.which(name)] or ["none"]


def _class(box: Path):
    """honest, honest_helper (imports a module it hands in) and root (the root attack) in ``box/subs``."""
    from attack_bank import ROOT
    from autograder.course.cells import read_nb, solution_submission
    from autograder.course.template import build_course
    from autograder_fixtures import LAB, SOLUTIONS, set_code, with_cell, write_class
    course = build_course([LAB], box / "course", solutions=SOLUTIONS)
    sol = solution_submission(read_nb(course / "source" / LAB / f"{LAB}.ipynb"),
                              read_nb(course / "release" / LAB / f"{LAB}.ipynb"))
    write_class(box / "subs", {"honest": sol, "honest_helper": set_code(sol, "add", "from my_helpers import add\n"),
                               "root": with_cell(sol, ROOT)})
    (box / "subs" / "honest_helper" / LAB / "my_helpers.py").write_text("def add(a, b):\n    return a + b\n")
    shutil.rmtree(box / "course")


def _behind_a_private_folder(keep_base: Path, *also: Path) -> str:
    """Shell commands for a private mount namespace (as root) in which the checkout's folder is 0700,
    as ``mktemp -d`` makes it, and everything keeps its path (the kernel's spec names the checkout's
    interpreter by its path): the checkout (and ``also``, where the folder holds them) is kept aside
    by a bind mount, a 0700 tmpfs covers the folder, and they are bound back in place."""
    folder = REPO.resolve().parent
    kept = [REPO.resolve()] + [p.resolve() for p in also if p.resolve().is_relative_to(folder)]
    steps = [f"mkdir -p {keep_base}/{i} && mount --bind {p} {keep_base}/{i}" for i, p in enumerate(kept)]
    steps.append(f"mount -t tmpfs -o mode=0700 tmpfs {folder}")
    steps += [f"mkdir -p {p} && mount --bind {keep_base}/{i} {p}" for i, p in enumerate(kept)]
    return " && ".join(["umask 022"] + steps)


def _keep_base() -> Path:
    """A folder outside the checkout's folder, for the bind mounts that keep things aside."""
    folder = REPO.resolve().parent
    for base in ("/dev/shm", "/var/tmp", "/tmp", "/run"):
        if os.path.isdir(base) and not Path(base).resolve().is_relative_to(folder):
            return Path(tempfile.mkdtemp(prefix="keep-", dir=base))
    pytest.skip(f"no folder outside {folder} to keep the checkout aside in")


@needs_root
@pytest.mark.parametrize("backend", _backends())
def test_a_root_grader_grades_a_course_kept_in_a_private_folder(backend):
    if backend == "none":
        pytest.skip("neither bwrap nor unshare is installed")
    from autograder_fixtures import LAB
    box = Path(tempfile.mkdtemp(prefix="private-course-"))         # 0700, as mktemp -d makes it
    keep = box
    try:
        assert os.stat(box).st_mode & 0o777 == 0o700
        _class(box)
        keep = _keep_base()
        fixture = REPO / "tests" / "fixtures" / "course"
        # a root shell's umask on such a server is often 0077: the folders and copies the grader makes
        # for its jobs must not inherit it
        script = (_behind_a_private_folder(keep, box) + f" && cd {REPO} && umask 077 && exec env "
                  f"MINIDIST_SANDBOX={backend} MINIDIST_SOLUTIONS={fixture}/solutions "
                  f"MINIDIST_LABS={box}/labs {sys.executable} -m autograder grade {box}/subs --out {box}/out --jobs 2 "
                  f"--lab {LAB} --cell-timeout 20 --wall-timeout 150 --quiet --sandbox")
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        assert f"sandbox: {backend}" in r.stdout, r.stdout[-2000:]
        rows = {(row["student"], row["cell"]): row for row in csv.DictReader(open(box / "out" / "results.csv"))}
        grades = {row["student_id"]: float(row["score"]) for row in csv.DictReader(open(box / "out" / "grades.csv"))}
        assert grades == {"honest": 3.0, "honest_helper": 3.0, "root": 3.0}, (grades, [(k, r["reason"]) for k, r in rows.items()])
        for (student, cell), row in rows.items():
            assert row["confirmed"] == "passed" and "not confirmed" not in row["flags"], row
        from autograder.course.cells import read_nb
        nb = read_nb(box / "out" / "autograded" / "root" / LAB / f"{LAB}.ipynb")
        said = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        assert said.count("refused ") == 6 and "wrote " not in said, said
    finally:
        shutil.rmtree(box, ignore_errors=True)
        shutil.rmtree(keep, ignore_errors=True)


@needs_root
def test_a_job_uid_that_cannot_reach_the_interpreter_stops_the_grader_at_once(tmp_path):
    """An interpreter in a 0700 folder of its own: the sandbox makes the folders above it traversable,
    not the folder itself. The grader stops before the first job, in seconds, naming the path, the
    folder that blocks it and what to do; nothing is graded and nothing is written."""
    if _backends() == ["none"]:
        pytest.skip("neither bwrap nor unshare is installed")
    from autograder_fixtures import LAB, SOLUTIONS
    box = Path(tempfile.mkdtemp(prefix="blocked-venv-"))
    try:
        venv = box / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True, capture_output=True)
        site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # the grader's own packages, seen through a .pth (the job's uid is stopped before that matters)
        Path(site, "grader.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
        os.chmod(venv, 0o700)
        (box / "subs" / "s1" / LAB).mkdir(parents=True)
        t0 = time.time()
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "autograder", "grade", str(box / "subs"),
                            "--out", str(box / "out"), "--lab", LAB, "--quiet"], capture_output=True, text=True,
                           timeout=120, cwd=str(REPO),
                           env=dict(os.environ, MINIDIST_SOLUTIONS=str(SOLUTIONS),
                                    MINIDIST_LABS=str(tmp_path / "labs"), PYTHONPATH=str(REPO)))
        took = time.time() - t0
        wrote = sorted(p.name for p in (box / "out").glob("*")) if (box / "out").exists() else []
    finally:
        shutil.rmtree(box, ignore_errors=True)
    assert r.returncode == 1 and took < 30, (took, r.stdout[-2000:], r.stderr[-2000:])
    said = r.stderr
    assert "the grading jobs cannot reach what they need" in said, said
    assert f"{venv}/bin/python: blocked at {venv} (mode 0700, owner root)" in said, said
    assert f"chmod -R o+rX '{venv}'" in said and "Nothing was graded." in said, said
    assert not [name for name in wrote if name != "_work"], wrote


def test_a_kernel_that_cannot_start_is_reported_in_seconds_as_the_machines_problem(tmp_path, monkeypatch):
    """A job whose kernel dies before its first cell (here: a sandbox memory cap too small for an
    interpreter to start) is reported within seconds, never after the wall-clock limit, and its reason
    says that nothing of the submission ran."""
    from autograder.course.cells import read_nb, solution_submission
    from autograder.course.template import build_course
    from autograder.grading.grade import grade
    from autograder.sandbox.probe import probe
    from autograder_fixtures import LAB, SOLUTIONS, write_class
    if probe()[0] is None:
        pytest.skip("no sandbox here: nothing caps a kernel's memory")
    monkeypatch.setenv("MINIDIST_SOLUTIONS", str(SOLUTIONS))
    monkeypatch.setenv("MINIDIST_LABS", str(tmp_path / "labs"))
    root = build_course([LAB], tmp_path / "course")
    write_class(tmp_path / "subs", {"s1": solution_submission(read_nb(root / "source" / LAB / f"{LAB}.ipynb"),
                                                              read_nb(root / "release" / LAB / f"{LAB}.ipynb"))})
    monkeypatch.setenv("MINIDIST_SANDBOX_MEMORY_GB", "0.02")
    t0 = time.time()
    grade(tmp_path / "subs", tmp_path / "out", labs=[LAB], cell_timeout_s=20, wall_s=150, progress=False)
    took = time.time() - t0
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert took < 30, took
    assert rows and all(r["points"] == "0.0" and r["reason"].startswith(
        "the kernel could not start (a problem of the grading machine, not of the submission") for r in rows), rows
