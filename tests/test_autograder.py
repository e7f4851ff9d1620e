"""End-to-end tests of python -m autograder on the fixture lab (tests/fixtures/course).

The broken submissions are graded as ONE batch with --jobs 2 (module fixture) and the
tests assert on its outputs, to keep the suite fast. Two attacks of the attack bank ride in it (a
verdict forged in the kernel and in the confirmation's child, a library answer run through ``exec``);
with the root kernel of tests/test_private_folder.py and test_sandbox.py, `make test` grades one
attack on each layer of the defence. The whole banks are tests/test_cheats.py (`make test-e2e`).
"""
from __future__ import annotations

import copy
import csv
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from nbformat.v4 import new_code_cell

from attack_bank import attack_bank, misjudged
from autograder_fixtures import (CELL_TIMEOUT, LAB, SOLUTIONS, WALL, broken_class,
                                 set_code, write_class)

REPO = Path(__file__).resolve().parent.parent
# grade --due: sol2 hands in 25 h late (2 started days: 20 % off with the course's per-day penalty)
DUE = "2025-01-10 12:00:00 +0000"
TIMESTAMPS = {"sol2": "2025-01-11 13:00:00.000000 UTC", "sol3": "2025-01-10 11:00:00.000000 UTC"}
#: the attack bank's submissions graded in this batch (tests/attack_bank.py says what each deserves)
ATTACKS = ("walk_stack", "exec_library")


@pytest.fixture(scope="module", autouse=True)
def fixture_course(tmp_path_factory):
    old = {k: os.environ.get(k) for k in ("MINIDIST_SOLUTIONS", "MINIDIST_LABS")}
    os.environ["MINIDIST_SOLUTIONS"] = str(SOLUTIONS)
    os.environ["MINIDIST_LABS"] = str(tmp_path_factory.mktemp("labs"))
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def course(tmp_path_factory, fixture_course):
    from autograder.course.cells import read_nb, solution_submission
    from autograder.course.template import build_course
    root = build_course([LAB], tmp_path_factory.mktemp("course"))
    src = read_nb(root / "source" / LAB / f"{LAB}.ipynb")
    rel = read_nb(root / "release" / LAB / f"{LAB}.ipynb")
    return {"root": root, "source": src, "release": rel, "solution": solution_submission(src, rel)}


@pytest.fixture(scope="module")
def graded(course, tmp_path_factory):
    from autograder.grading.grade import grade
    attacks = {s: a for s, a in attack_bank(course["solution"], course["release"]).items() if s in ATTACKS}
    assert all(not files for _, files, _, _ in attacks.values())
    subs = write_class(tmp_path_factory.mktemp("subs"),
                       {**broken_class(course["solution"], course["release"], course["source"]),
                        **{s: nb for s, (nb, _, _, _) in attacks.items()}})
    for student, when in TIMESTAMPS.items():
        (subs / student / LAB / "timestamp.txt").write_text(when)
    out = tmp_path_factory.mktemp("out")
    t0 = time.time()
    r = grade(subs, out, jobs=2, labs=[LAB], cell_timeout_s=CELL_TIMEOUT, wall_s=WALL, progress=False,
              due={LAB: DUE})
    r["attacks"] = attacks
    r["subs"] = subs
    r["elapsed"] = time.time() - t0
    rows = list(csv.DictReader(open(out / "results.csv")))
    r["cells"] = {(row["student"], row["cell"]): row for row in rows}
    r["grades"] = {row["student_id"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    r["json"] = json.loads((out / "results.json").read_text())
    return r


def row(g, student, cell):
    return g["cells"][(student, cell)]


def total(g, student):
    return float(g["grades"][student]["score"])


# ---------------------------------------------------------------- outputs
def test_every_submission_gets_a_grade_and_reasons(graded, course):
    from autograder_fixtures import broken_class
    students = set(broken_class(course["solution"], course["release"], course["source"])) | set(ATTACKS)
    assert set(graded["grades"]) == students
    for s in students:
        for c in ("test_add", "test_allsum"):
            r = row(graded, s, c)
            assert r["status"] in {"pass", "fail", "error", "timeout"}, r
            assert r["reason"].strip(), r
            assert "\n" not in r["reason"]


def test_grades_csv_has_nbgrader_export_columns(graded):
    header = open(graded["out"] / "grades.csv").readline().strip().split(",")
    assert header == ["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name",
                      "email", "raw_score", "late_submission_penalty", "score", "max_score",
                      "manual_points_pending", "needs_manual_grade"]
    assert graded["grades"]["sol1"]["max_score"] == "3.0"


def test_solution_full_marks_release_zero(graded):
    assert total(graded, "sol1") == 3.0
    assert row(graded, "sol1", "test_allsum")["status"] == "pass"
    assert total(graded, "release") == 0.0
    assert row(graded, "release", "test_add")["reason"].startswith("NotImplementedError")


def test_deterministic(graded):
    """The same submission graded three times gets identical scores and statuses."""
    views = [[(c, row(graded, s, c)["points"], row(graded, s, c)["status"])
              for c in ("test_add", "test_allsum")] for s in ("sol1", "sol2", "sol3")]
    assert views[0] == views[1] == views[2]


def test_two_attacks_gain_nothing(graded):
    """A verdict forged in the kernel and in the confirmation's child (refused by its parent), and a
    library answer under another file name (refused by the check)."""
    assert misjudged(graded["attacks"], graded["grades"], graded["cells"]) == []
    assert "sys._getframe" in row(graded, "walk_stack", "test_add")["flags"]
    assert "called minidist's own implementation: mine.ring_all_reduce" in row(graded, "exec_library", "test_allsum")["reason"]


# ---------------------------------------------------------------- instructor workflow
def test_due_date_and_late_penalty(graded):
    g = graded["grades"]
    assert g["sol1"]["duedate"].startswith("2025-01-10 12:00:00") and g["sol1"]["late_submission_penalty"] == "0.0"
    assert g["sol3"]["late_submission_penalty"] == "0.0" and float(g["sol3"]["score"]) == 3.0
    assert float(g["sol2"]["late_submission_penalty"]) == pytest.approx(0.6)
    assert float(g["sol2"]["score"]) == pytest.approx(2.4) and float(g["sol2"]["raw_score"]) == 3.0


def test_regrade_some_students_merges(graded, course, tmp_path):
    """grade --student: the release student hands in the solution and is re-graded alone; everyone
    else keeps their row, in results and in grades.csv."""
    import shutil
    from autograder.grading.grade import grade
    out = tmp_path / "out"
    shutil.copytree(graded["out"], out)
    subs = tmp_path / "subs"
    shutil.copytree(graded["subs"], subs)
    write_class(subs, {"release": course["solution"]})
    r = grade(subs, out, jobs=1, labs=[LAB], cell_timeout_s=CELL_TIMEOUT, wall_s=WALL, progress=False,
              students=["release"], due={LAB: DUE})
    assert [j.student for j in r["jobs"]] == ["release"]
    grades = {row["student_id"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    assert set(grades) == set(graded["grades"])
    assert float(grades["release"]["score"]) == 3.0
    for s, before in graded["grades"].items():
        if s != "release":
            assert grades[s] == before, s
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {(x["student"], x["cell"]) for x in rows} == set(graded["cells"])


# ---------------------------------------------------------------- robustness
def test_deadlocking_rank_is_a_timeout_with_launch_error(graded):
    r = row(graded, "deadlock", "test_allsum")
    assert r["status"] == "timeout" and "LaunchError" in r["reason"], r
    assert row(graded, "deadlock", "test_add")["status"] == "pass"


def test_infinite_loop_hits_cell_timeout(graded):
    sub = next(s for s in graded["json"]["submissions"] if s["student"] == "infloop")
    assert row(graded, "infloop", "test_add")["status"] == "error"      # add never defined
    assert "NameError" in row(graded, "infloop", "test_add")["reason"]
    assert row(graded, "infloop", "test_allsum")["status"] == "pass"
    assert sub["seconds"] < WALL


def test_sys_exit_in_a_cell(graded):
    assert row(graded, "sysexit", "test_add")["status"] == "error"
    assert row(graded, "sysexit", "test_allsum")["status"] == "pass"


@pytest.mark.parametrize("student,dies_in", [("osexit", "allsum"), ("segfault", "allsum"),
                                             ("sigkill", "add")])
def test_dead_kernel_gets_partial_grade_and_reason(graded, student, dies_in):
    a, s = row(graded, student, "test_add"), row(graded, student, "test_allsum")
    assert "kernel died" in s["reason"] and repr(dies_in) in s["reason"], s
    assert s["points"] == "0.0"
    if dies_in == "allsum":      # test_add ran before the crash: keeps its point
        assert a["status"] == "pass" and a["points"] == "1.0"
    else:
        assert a["points"] == "0.0" and "kernel died" in a["reason"]


def test_megabytes_of_output(graded):
    assert total(graded, "bigoutput") == 3.0
    fb = graded["out"] / "feedback" / "bigoutput" / LAB / f"{LAB}.html"
    assert fb.stat().st_size < 1_000_000


def test_deleted_test_cell_restored_and_flagged(graded):
    r = row(graded, "deleted_test", "test_add")
    assert r["status"] == "pass" and "deleted" in r["flags"], r
    assert total(graded, "deleted_test") == 3.0


def test_deleted_solution_cell(graded):
    r = row(graded, "deleted_solution", "test_allsum")
    assert r["points"] == "0.0" and "NotImplementedError" in r["reason"]


def test_renamed_cell_restored_and_flagged(graded):
    assert total(graded, "renamed") == 3.0
    assert "my_add" in row(graded, "renamed", "test_add")["flags"]


def test_modified_locked_test_cell_restored_and_flagged(graded):
    r = row(graded, "tampered", "test_add")
    assert r["status"] == "fail" and r["points"] == "0.0", r       # real test ran, caught a - b
    assert r["max_points"] == "1.0"                               # points tampering undone
    assert "locked cell was modified; restored" in r["flags"]


def test_a_notebook_from_the_source_gets_one_note(graded):
    """The source notebook handed in (hidden tests, nbgrader's metadata without the release's checksums):
    full marks, one note for the notebook instead of a "restored" flag per cell."""
    assert total(graded, "fromsource") == 3.0
    for c in ("test_add", "test_allsum"):
        flags = row(graded, "fromsource", c)["flags"]
        assert "restored" not in flags and flags.count("handed in from the source notebook") == 1, flags


def test_rows_carry_no_batch_wide_text(graded):
    """The sandbox and the batch's other facts are in batch.json (and the summary), once; no row has them."""
    facts = json.loads((graded["out"] / "batch.json").read_text())
    assert facts["sandbox"] == graded["meta"]["sandbox"] and facts["confirmation"] is True
    assert facts["rows"] == len(graded["cells"]) and facts["submissions"] == len(graded["grades"])
    header = open(graded["out"] / "results.csv").readline().strip().split(",")
    assert "sandbox" not in header and header[-1] == "similarity"
    batch_wide = [str(facts["sandbox"]), "sandbox", "confirmation run on", str(facts["wall_clock_limit_s"]) + " s"]
    for r in graded["cells"].values():
        for text in batch_wide:
            assert not any(text in str(v) for k, v in r.items() if k != "student"), (text, r)
    assert row(graded, "sol1", "test_add")["flags"] == ""         # an honest submission: nothing to read


def test_missing_notebook(graded):
    assert total(graded, "missing") == 0.0
    assert "missing notebook toylab.ipynb" in row(graded, "missing", "test_add")["reason"]


def test_wrongly_named_notebook(graded):
    assert total(graded, "wrongname") == 3.0
    assert "toylab-Copy1.ipynb" in row(graded, "wrongname", "test_add")["flags"]


def test_corrupt_json(graded):
    assert total(graded, "corrupt") == 0.0
    assert "not a readable notebook" in row(graded, "corrupt", "test_add")["reason"]


def test_parallel_batch_is_fast_enough(graded):
    # 22 submissions, several of which hit 10 s timeouts: the batch must not serialise
    n = len(graded["grades"])
    assert graded["elapsed"] < n * 15, graded["elapsed"]


# ---------------------------------------------------------------- feedback
def test_feedback_per_student_hides_hidden_tests(graded, course):
    from autograder.course.hidden_tests import hidden_test_lines
    hidden = hidden_test_lines(course["source"])
    assert hidden, "fixture must have hidden tests"
    files = sorted((graded["out"] / "feedback").glob(f"*/{LAB}/{LAB}.html"))
    assert len(files) == len(graded["grades"])
    for f in files:
        text = html.unescape(f.read_text())
        for line in hidden:
            assert line not in text, (f, line)
    sol = html.unescape((graded["out"] / "feedback" / "sol1" / LAB / f"{LAB}.html").read_text())
    assert "hidden tests not shown" in sol and "test_allsum" in sol
    # a failing hidden test keeps its message but not its source
    bad = html.unescape((graded["out"] / "feedback" / "tampered" / LAB / f"{LAB}.html").read_text())
    assert "AssertionError" in bad


def test_feedback_command_finds_no_leak(graded, tmp_path):
    from autograder.reports.feedback import collect
    made, leaks = collect(graded["out"], tmp_path / "handback")
    assert not leaks and made
    assert (tmp_path / "handback" / "sol1" / LAB / f"{LAB}.html").is_file()


def test_export_reproduces_grades_csv(graded, tmp_path):
    from autograder.grading.gradebook import export_csv
    export_csv(graded["out"] / "gradebook.db", tmp_path / "g.csv")
    assert (tmp_path / "g.csv").read_text() == (graded["out"] / "grades.csv").read_text()


# ---------------------------------------------------------------- GPUs per job
def test_parallel_jobs_get_disjoint_gpus_and_their_own_environment(tmp_path, monkeypatch):
    """``grade --gpus-per-job K``: each job's environment (its worker's, kernels' and confirmation's)
    has K GPUs of its own as CUDA_VISIBLE_DEVICES, never one a running job holds; too many jobs
    for the GPUs is an error before anything is graded."""
    import threading
    from types import SimpleNamespace
    from autograder.grading.grade import gpu_slots, grade, run_all, visible_gpu_ids
    lock, running, seen = threading.Lock(), {}, []

    def fake_run(job, env):
        mine = set(env["CUDA_VISIBLE_DEVICES"].split(","))
        with lock:
            assert not any(mine & other for other in running.values()), (job.student, running)
            running[job.student] = mine
            seen.append((job.student, env["CUDA_VISIBLE_DEVICES"], env["MINIDIST_SANDBOX_GPU"], env.get("EXTRA")))
        time.sleep(0.05)
        with lock:
            del running[job.student]
        job.result = {}
        return job

    todo = [SimpleNamespace(student=f"s{k}", result=None) for k in range(8)]
    slots = gpu_slots(2, 3, visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6"}))
    assert slots == ["0,1,2", "3,4,5"]
    done = [j for j, f in run_all(todo, 2, {"BASE": "1"}, fake_run, slots, {"s3": {"EXTRA": "meta"}})]
    assert sorted(j.student for j in done) == [f"s{k}" for k in range(8)]
    assert {g for _, g, _, _ in seen} == set(slots) and {a for _, _, a, _ in seen} == {"1"}
    assert [s for s, _, _, e in seen if e] == ["s3"] and all(j.result["gpus"] in slots for j in done)
    (tmp_path / "subs").mkdir()
    for env, jobs, message in (("0,1,2,3", 3, "needs 6 GPUs, but 4 are visible"), ("", 1, "only 0 visible")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        with pytest.raises(SystemExit, match=message):
            grade(tmp_path / "subs", tmp_path / "out", jobs=jobs, gpus_per_job=2, progress=False)
    assert not (tmp_path / "out").exists()       # refused before anything was written


# ---------------------------------------------------------------- wall clock, orphans
def _processes_with(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes() and \
                    "Z" not in (p / "stat").read_text().split()[2]:
                out.append(int(p.name))
        except OSError:
            pass
    return out


def test_wall_clock_limit_kills_everything(course, tmp_path):
    # the orphans are found by their command line (a sandboxed kernel cannot write outside its folder)
    from autograder.grading.grade import grade
    marker = f"{300 + (os.getpid() % 1000) / 1000:.3f}"
    spawn = ("import subprocess\n"
             f"p = subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n")
    # the staller patches the check in its kernel, passes test_allsum there, then sleeps past the
    # limit: the points its notebook earned are not confirmed, so it keeps none
    staller = copy.deepcopy(course["release"])
    i = next(k for k, c in enumerate(staller.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == "setup")
    staller.cells.insert(i + 1, new_code_cell("checks.check_allsum = lambda *a, **k: None"))
    staller.cells.append(new_code_cell("import time\ntime.sleep(1000)"))
    subs = write_class(tmp_path / "subs", {
        "orphan": set_code(course["solution"], "add", spawn + "def add(a, b):\n    return a + b"),
        "sleeper": set_code(course["solution"], "add", spawn + "import time\ntime.sleep(1000)"),
        "staller": staller,
    })
    t0 = time.time()
    r = grade(subs, tmp_path / "out", jobs=3, labs=[LAB], cell_timeout_s=300, wall_s=25,
              progress=False)
    assert time.time() - t0 < 90
    res = {(j.student, c): rr for j in r["jobs"] for c, rr in j.result["cells"][LAB].items()}
    assert res[("orphan", "test_add")]["status"] == "pass"       # so its sleep was started
    s = res[("sleeper", "test_add")]
    assert s["status"] == "timeout" and "wall-clock" in s["reason"] and "'add'" in s["reason"], s
    s = res[("staller", "test_allsum")]
    assert s["points"] == 0.0 and "not confirmed" in s["reason"], s
    time.sleep(0.5)
    assert _processes_with(marker) == [], "an orphan survived grading"


def test_a_stopped_grader_stops_every_job_and_writes_nothing(course, tmp_path):
    # an instructor's Ctrl-C or a scheduler's SIGTERM: the running submissions are killed, not
    # left to finish on their own for minutes, and no half-graded batch lands in OUT
    marker = f"{400 + (os.getpid() % 1000) / 1000:.3f}"
    spawn = ("import subprocess\n"
             f"p = subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n")
    subs = write_class(tmp_path / "subs", {
        f"sleeper{i}": set_code(course["solution"], "add", spawn + "import time\ntime.sleep(1000)")
        for i in range(3)})
    out = tmp_path / "out"
    grader = subprocess.Popen([sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out),
                               "--lab", LAB, "--jobs", "2", "--quiet"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not _processes_with(marker) and time.time() < deadline and grader.poll() is None:
        time.sleep(0.2)
    assert _processes_with(marker), "a submission should be running"
    t0 = time.time()
    grader.send_signal(signal.SIGTERM)
    _, err = grader.communicate(timeout=30)
    assert time.time() - t0 < 10, "the grader took long to stop"
    assert grader.returncode == 128 + signal.SIGTERM, err
    assert "interrupted" in err and "0 of 3 submissions had finished" in err, err
    time.sleep(0.5)
    assert _processes_with(marker) == [], "a submission's process survived the grader"
    assert not (out / "grades.csv").exists() and not (out / "_work").exists()


# ---------------------------------------------------------------- release
def test_release_check_detects_stale_labs(tmp_path):
    from autograder.handout import release
    labs = tmp_path / "labs"
    release.release(labs_dir=labs)
    assert release.check(labs) == []
    nb = labs / LAB / f"{LAB}.ipynb"
    nb.write_text(nb.read_text().replace("Implement", "Please implement"))
    (labs / "stale_lab").mkdir()
    problems = release.check(labs)
    assert any("differs" in p for p in problems) and any("stale_lab" in p for p in problems)


def test_release_has_no_hidden_tests_or_solutions(tmp_path, course):
    from autograder.course.hidden_tests import hidden_test_lines
    from autograder.handout import release
    labs = tmp_path / "labs"
    release.release(labs_dir=labs)
    text = (labs / LAB / f"{LAB}.ipynb").read_text()
    for line in hidden_test_lines(course["source"]):
        assert line not in text
    assert "BEGIN SOLUTION" not in text and "dist.all_reduce(y)" not in text


def test_repo_labs_match_fresh_release():
    """make test: labs/ must be exactly what `python -m autograder release` generates."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIDIST_")}
    r = subprocess.run([sys.executable, "-m", "autograder", "release", "--check"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_repo_labs_contain_no_hidden_tests():
    from autograder.course.cells import read_nb
    from autograder.course.hidden_tests import hidden_test_lines
    for src in sorted((REPO / "solutions").glob("*/*.ipynb")):
        rel = REPO / "labs" / src.parent.name / src.name
        if not rel.exists():
            continue
        text = rel.read_text()
        for line in hidden_test_lines(read_nb(src)):
            assert line not in text, (rel, line)


def test_a_new_gradebook_is_stamped_with_nbgrader_s_newest_migration(course):
    # the revision is read in-process instead of by nbgrader's alembic subprocess (5 s per course):
    # it must be the one revision of nbgrader's migration files that no other one builds on
    import re
    import sqlite3

    import nbgrader
    revisions, parents = set(), set()
    for f in (Path(nbgrader.__file__).parent / "alembic" / "versions").glob("*.py"):
        text = f.read_text()
        revisions |= set(re.findall(r"^revision = '(\w+)'", text, re.M))
        parents |= set(re.findall(r"^down_revision = '(\w+)'", text, re.M))
    [head] = revisions - parents
    with sqlite3.connect(course["root"] / "gradebook.db") as db:
        assert db.execute("select version_num from alembic_version").fetchall() == [(head,)]


# ---------------------------------------------------------------- kernel
def test_kernel_is_pinned_and_has_minidist():
    from autograder.course.config import load_config
    from autograder.course.kernel import kernel_argv
    assert load_config().Execute.kernel_name == "minidist"
    argv = kernel_argv()
    r = subprocess.run([argv[0], "-c", "import minidist; print(minidist.__file__)"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "minidist" in r.stdout


def test_cell_timeout_exceeds_launch_timeouts():
    from autograder.course.config import cell_timeout
    assert cell_timeout() > 30            # tests use launch timeouts <= 30 s
    from minidist.checks import toylab
    assert CELL_TIMEOUT > toylab.ALLSUM.timeout       # the fixture's launch


# ---------------------------------------------------------------- selftest
@pytest.mark.e2e        # about a minute on 2 cores: `make test-e2e`, which `.ci/run` runs
def test_selftest_reports_uncaught_bugs_and_thin_banks(tmp_path, monkeypatch, capsys, course):
    """A bank with one real bug, one bug no test can see, a correct alternative, a wrong one,
    and too few bugs and alternatives per function: graded as submissions, and in a kernel."""
    solutions = tmp_path / "solutions"           # the fixture course, with this bank beside the solution
    shutil.copytree(SOLUTIONS, solutions)
    (solutions / LAB / "bugbank.py").write_text(
        "BUGS = [\n"
        "  dict(name='subtracts', cell='add', replace=[('return a + b', 'return a - b')],\n"
        "       catches=['test_add']),\n"
        "  dict(name='harmless', cell='add', code='def add(a, b):\\n    return b + a',\n"
        "       catches=['test_add']),\n"
        "]\n"
        "ALTERNATIVES = [\n"
        "  dict(name='commuted', cell='add', code='def add(a, b):\\n    return b + a'),\n"
        "  dict(name='not_really', cell='add', code='def add(a, b):\\n    return int(a + b)'),\n"
        "]\n")
    monkeypatch.setenv("MINIDIST_SOLUTIONS", str(solutions))
    from autograder.selftest.selftest import selftest
    ok = selftest(labs=[LAB], jobs=2, cell_timeout_s=CELL_TIMEOUT, wall_s=WALL, progress=False)
    out = capsys.readouterr().out
    assert not ok
    lines = {l.split()[1]: l for l in out.splitlines() if l.startswith(LAB)}
    assert " ok " in lines["solution"] and " ok " in lines["release"], out
    assert "not marked" in lines["device"] and " FAIL " not in lines["device"], out   # the fixture lab is not
    assert " ok " in lines["bug-subtracts"], out
    assert " FAIL " in lines["bug-harmless"] and "still full marks" in lines["bug-harmless"], out
    assert " ok " in lines["alt-commuted"], out
    assert " FAIL " in lines["alt-not_really"] and "test_add" in lines["alt-not_really"], out
    assert "'add' has 2 bugs" in out and "'allsum' has 0 bugs" in out, out
    assert "'allsum' has 0 correct alternatives" in out and "'add' has 2 correct" not in out, out

    # in a kernel (selftest --quick's bank check): the same bug and alternatives
    from autograder.selftest.bank import alternative_tests, load_bank
    from autograder.selftest.selftest import _quick_bug_rows
    bank = load_bank(LAB)
    assert alternative_tests(bank, bank["ALTERNATIVES"][0]) == ["test_add"]     # what the cell's bugs must fail
    # ... and a "release" whose stubs are the solution's code: it must be reported, not pass
    # ... and, as for a lab marked for device discipline, correct alternatives run with the meta
    # default device in the kernel's (hence the ranks') environment, bugs and the release without
    sensed = "__import__('os').environ.get('MINIDIST_RANK_DEFAULT_DEVICE') == 'meta'"
    bank["ALTERNATIVES"].append(dict(name="meta_only", cell="add", code=f"def add(a, b):\n    return a + b if {sensed} else a - b"))
    bank["BUGS"].append(dict(name="wrong_on_cpu", cell="add", catches=["test_add"],
                             code=f"def add(a, b):\n    return a + b if {sensed} else a - b"))
    rows = _quick_bug_rows(LAB, bank, {LAB: course["source"]}, {LAB: course["solution"]},
                           course["root"] / "source" / LAB, threading.Event(), {LAB: course["solution"]}, meta=True)
    lines = {who: (status, detail) for _, who, status, detail in rows}
    assert lines["alt-meta_only"][0] == "ok" and lines["bug-wrong_on_cpu"][0] == "ok", rows
    assert lines["release"][0] == "FAIL" and "test_add scored points" in lines["release"][1], rows
    assert lines["bug-subtracts"][0] == "ok" and lines["bug-harmless"][0] == "FAIL", rows
    assert lines["alt-commuted"][0] == "ok", rows
    assert lines["alt-not_really"][0] == "FAIL" and "lost points on test_add" in lines["alt-not_really"][1], rows

    # a solution that does not load in the bank's kernel: said once, with the cell and the error,
    # and no bug or alternative row (each would be meaningless)
    broken = set_code(course["solution"], "add", "raise RuntimeError('the solution cannot load')")
    rows = _quick_bug_rows(LAB, bank, {LAB: course["source"]}, {LAB: broken},
                           course["root"] / "source" / LAB, threading.Event())
    assert [(who, status) for _, who, status, _ in rows] == [("bugs (kernels)", "FAIL")], rows
    assert "cell add raised while loading" in rows[0][3] and "cannot load" in rows[0][3], rows


def test_bugbank_injection_rules(course):
    from autograder.selftest.bank import BankError, inject
    sol = {LAB: course["solution"]}
    nbs = inject(dict(name="x", cell="add", replace=[("return a + b", "return a * b")], catches=[]), sol)
    from autograder_fixtures import cell
    assert "return a * b" in cell(nbs[LAB], "add").source
    assert "a + b" in cell(sol[LAB], "add").source          # the solution is untouched
    with pytest.raises(BankError):
        inject(dict(name="y", cell="add", replace=[("nope", "x")], catches=[]), sol)
    with pytest.raises(BankError):
        inject(dict(name="z", cell="test_add", code="pass", catches=[]), sol)


AUDIT_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, minidist.checks.kit.launch
from autograder.confirm import audit
sys.addaudithook(audit.audit)
audit.STUDENT_CODE_LOADED = True      # as the runner sets it before the first solution cell
out = {}
for label, code in [("import", "import torch.distributed._functional_collectives as funcol\nfuncol.all_reduce"),
                    ("code", "import minidist.checks.kit.launch as c\n"
                             "c.report_passed.__code__ = (lambda *a, **k: None).__code__"),
                    ("frame", "import sys\nsys._getframe()"),
                    ("tb_frame", "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame"),
                    ("gi_frame", "g = (i for i in range(1))\ng.gi_frame")]:
    try:
        exec(compile(code, f"<solution {label}>", "exec"), {})
        out[label] = "ok"
    except RuntimeError as e:
        out[label] = str(e)
print(json.dumps(out))
"""


def test_the_confirmation_audit_lets_a_solution_import_torch_and_still_refuses_tampering():
    """A solution cell importing a torch module for the first time runs torch's own bookkeeping
    (a dataclass setting its __doc__): not the student's doing. Found grading lab 5's correct
    g through functional collectives, which lost 8 points as "not confirmed"."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", AUDIT_PROBE, here], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import"] == "ok", out
    # every way to a frame: the hook does not check a frame's f_code, only a frame has one
    assert all("refused in graded code" in out[k] for k in ("code", "frame", "tb_frame", "gi_frame")), out


def test_a_lab_is_named_by_its_number_or_prefix_and_an_unknown_one_lists_the_labs():
    from autograder.__main__ import main
    from autograder.course.labs import all_labs, resolve_lab
    labs = all_labs(REPO / "solutions")
    assert [resolve_lab(n, labs) for n in ("1", "lab1", "lab1_collectives")] == ["lab1_collectives"] * 3
    assert resolve_lab("9", labs) == "lab9_expert_parallel"
    assert resolve_lab(LAB) == LAB          # the fixture course's own lab, by its full name
    with pytest.raises(SystemExit) as e:
        main(["selftest", "--lab", "42"])
    assert e.value.code == 2
