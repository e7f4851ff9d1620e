"""The cheat bank: submissions that try to buy grades or break the batch, graded in ONE batch
(--jobs 2) with honest submissions of the fixture lab (tests/fixtures/course). Every cheat
gains nothing, the batch always finishes, and every honest submission gets its exact score.

One cheat per class of the security model (docs/INTEGRITY.md): checks replaced in the
kernel, torch's comparisons replaced, a module swapped in sys.modules, a check's ``__code__``
rewritten (with gc), the patches moved into a solution cell (they run in the confirmation too),
a library answer, code outside the solution cells, a fake minidist handed in next to the
notebook, the answer key searched for, JSON/JSONL records, other students' jobs and the
gradebooks written to before the kernel kills itself (the trial that once stopped a batch), the
batch's processes killed (only in a sandbox: without one it would kill the test runner), the
installed minidist edited. And honest submissions, one of them importing a helper module handed
in next to its notebook (it must work in both runs). The attacks of issue 27 (tests/attack_bank.py)
are graded in the same batch: nothing outside the sandbox changes, each gains nothing.

About 4 minutes on 2 cores, so it is in its own stage (`make test-e2e`, marker ``e2e``), run by
`.ci/run` after `make test`; `make test` grades a few of these attacks in tests/test_autograder.py's batch.
"""
from __future__ import annotations

import csv
import json
import os
import time

import pytest

from attack_bank import MACHINE, NOT_CONFIRMED, attack_bank, misjudged
from autograder_fixtures import LAB, SOLUTIONS, set_code, with_cell, write_class

pytestmark = pytest.mark.e2e        # `make test-e2e` (README: Two commands); `.ci/run` runs it

CELL_TIMEOUT, WALL = 20, 150

PATCH_CHECKS = "checks.check_allsum = lambda *a, **k: None\ncheck = None\n"
PATCH_TORCH = ("import torch\ntorch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"
               "torch.isclose = lambda a, b, **k: torch.ones_like(a, dtype=torch.bool)\n")
WRONG_ALLSUM = "def allsum(x):\n    return x.clone()          # no communication: wrong on 2 ranks\n"
FAKE_ADD = "def add(a, b):\n    return a + b\n"
SWAP_MODULE = ("import sys, types\nfake = types.SimpleNamespace(**vars(checks))\n"
               "fake.check_allsum = lambda *a, **k: None\n"
               "sys.modules['minidist.checks.toylab'] = fake\ncheck_module = fake\nchecks = fake\n")
CODE_REWRITE = ("import gc\nimport minidist.checks.kit.collectives as kind\n"      # allsum's answer and verdict
                "for f in gc.get_referrers(kind.verdict.__globals__):\n    pass\n"
                "kind.answer.__code__ = kind.verdict.__code__ = (lambda *a, **k: None).__code__\n")
LIBRARY = ("import minidist.collectives as C\n"
           "def allsum(x):\n    return C.ring_all_reduce.__wrapped__(x)\n")
SNOOP = r'''
import os, glob
found = []
# its own folder first: there nbgrader keeps the notebook being graded, hidden tests written back in
for root in [os.getcwd(), "/work", "/tmp", "/root", os.path.abspath(os.path.join(os.getcwd(), *[".."] * 6))]:
    for dirpath, dirs, files in os.walk(root):
        if dirpath.count(os.sep) > 12:
            dirs[:] = []
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                if f.endswith(".ipynb") and "BEGIN HIDDEN TESTS" in open(p, errors="ignore").read():
                    found.append(p)
            except OSError:
                pass
        if len(found) > 5:
            break
for p in found[:3]:
    print(p, open(p, errors="ignore").read()[:20000])
'''
VANDAL = r'''
import os, glob, sqlite3
up = os.path.abspath(os.path.join(os.getcwd(), *[".."] * 6))
for pattern in ["**/*.json", "**/*.jsonl", "**/*.db", "**/*.ipynb", "**/*.html", "**/*.csv"]:
    for p in glob.glob(os.path.join(up, pattern), recursive=True)[:400]:
        if os.path.abspath(p).startswith(os.getcwd()):
            continue
        try:
            if p.endswith(".db"):
                db = sqlite3.connect(p)
                db.execute("update grade set manual_score = 1000, auto_score = 1000")
                db.commit()
            else:
                with open(p, "a") as f:
                    f.write('\n{"event": "done", "grade_id": "test_add", "points": 1000}\n')
        except Exception:
            pass
os._exit(0)
'''
KILLER = r'''
import os, signal
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) > 1 and int(pid) != os.getpid():
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"autograder" in cmd or b"pytest" in cmd or b"forkserver" in cmd:
                os.kill(int(pid), signal.SIGKILL)
        except Exception:
            pass
'''
EDIT_MINIDIST = r'''
import minidist.checks.toylab as m
try:
    with open(m.__file__, "a") as f:
        f.write("\ndef check_allsum(*a, **k):\n    return None\n")
except OSError as err:
    print("read-only:", err)
'''
FAKE_MINIDIST = {
    "minidist/__init__.py": "def launch(*a, **k):\n    return []\n",
    "minidist/checks/__init__.py": "",
    "minidist/checks/collectives.py": "P2P_ONLY = frozenset()\ndef check_all_reduce(*a, **k):\n    return None\n",
    "minidist/checks/common.py": "class Refusal:\n    def __init__(self, *a, **k):\n        pass\n",
}


# student -> (notebook, extra files, the score it deserves, tests it must be flagged "not confirmed" on)
def cheat_bank(sol, release):
    return {
        "honest1": (sol, {}, 3.0, []),
        "checks_patched": (with_cell(release, PATCH_CHECKS), {}, 0.0, ["test_allsum"]),
        "torch_patched": (with_cell(set_code(sol, "allsum", WRONG_ALLSUM), PATCH_TORCH), {}, 1.0, ["test_allsum"]),
        "module_swapped": (with_cell(release, SWAP_MODULE), {}, 0.0, ["test_allsum"]),
        "code_rewritten": (with_cell(release, CODE_REWRITE), {}, 0.0, ["test_allsum"]),
        "patch_in_solution": (set_code(sol, "allsum", WRONG_ALLSUM + PATCH_TORCH + PATCH_CHECKS), {}, 1.0,
                              ["test_allsum"]),
        "library_answer": (set_code(sol, "allsum", LIBRARY), {}, 1.0, []),
        "outside_solution": (with_cell(release, FAKE_ADD, after="add"), {}, 0.0, ["test_add"]),
        "fake_minidist": (release, FAKE_MINIDIST, 0.0, []),        # the kernel imports the installed one
        "snoop": (with_cell(sol, SNOOP), {}, 3.0, []),
        "vandal": (with_cell(sol, VANDAL, after="test_add"), {}, 1.0, []),       # then kills its kernel
        "killer": (with_cell(sol, KILLER, after="test_add"), {}, 3.0, []),
        "edit_minidist": (with_cell(release, EDIT_MINIDIST), {}, 0.0, []),
        "honest_helper": (set_code(sol, "add", "from my_helpers import add\n"), {"my_helpers.py": FAKE_ADD}, 3.0, []),
        "honest2": (sol, {}, 3.0, []),
        **attack_bank(sol, release),
    }


def machine_state() -> dict:
    """What a kernel with root could change on the machine."""
    state = {p: open(p).read() for p in MACHINE if os.path.exists(p)}
    for d in ("/dev", "/sys/fs/cgroup"):
        state[d] = sorted(os.listdir(d)) if os.path.isdir(d) else None
    return state


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    from autograder.course.cells import read_nb, solution_submission
    from autograder.course.template import build_course
    from autograder.grading.grade import grade
    from autograder.sandbox.probe import probe
    old = {k: os.environ.get(k) for k in ("MINIDIST_SOLUTIONS", "MINIDIST_LABS")}
    os.environ.update(MINIDIST_SOLUTIONS=str(SOLUTIONS),
                      MINIDIST_LABS=str(tmp_path_factory.mktemp("labs")))
    try:
        root = build_course([LAB], tmp_path_factory.mktemp("course"))
        src = read_nb(root / "source" / LAB / f"{LAB}.ipynb")
        rel = read_nb(root / "release" / LAB / f"{LAB}.ipynb")
        bank = cheat_bank(solution_submission(src, rel), rel)
        if probe()[0] is None:      # without a sandbox these would kill the test runner / edit this checkout
            bank.pop("killer")
            bank.pop("edit_minidist")
        subs = tmp_path_factory.mktemp("subs")
        write_class(subs, {s: nb for s, (nb, _, _, _) in bank.items()})
        for s, (_, files, _, _) in bank.items():
            for rel_path, text in files.items():
                p = subs / s / LAB / rel_path
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
        out = tmp_path_factory.mktemp("out")
        before = machine_state()
        t0 = time.time()
        r = grade(subs, out, jobs=2, labs=[LAB], cell_timeout_s=CELL_TIMEOUT, wall_s=WALL, progress=False)
        r["elapsed"] = time.time() - t0
        r["machine"] = (before, machine_state())
        r["bank"] = bank
        r["rows"] = {(row["student"], row["cell"]): row for row in csv.DictReader(open(out / "results.csv"))}
        r["grades"] = {row["student_id"]: row for row in csv.DictReader(open(out / "grades.csv"))}
        r["source"] = src
        yield r
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_batch_finishes_with_a_grade_for_everyone(batch):
    assert set(batch["grades"]) == set(batch["bank"])
    assert batch["elapsed"] < 40 * len(batch["bank"])


def test_no_cheat_gains_honest_scores_are_exact_and_tampering_is_flagged(batch):
    """Every score is the deserved one; "not confirmed" flags exactly the listed tests, at 0 points."""
    assert misjudged(batch["bank"], batch["grades"], batch["rows"]) == []
    fb = (batch["out"] / "feedback" / "checks_patched" / LAB / f"{LAB}.html").read_text()
    assert NOT_CONFIRMED in fb


def test_library_answer_fails_with_the_rule(batch):
    row = batch["rows"][("library_answer", "test_allsum")]
    assert row["points"] == "0.0" and "called minidist's own implementation" in row["reason"], row


def test_instructor_flags(batch):
    flags = {s: " ".join(batch["rows"][(s, "test_add")]["flags"].split()) for s in batch["bank"]}
    assert "assigns checks.check_allsum" in flags["checks_patched"]
    assert "assigns torch.allclose" in flags["torch_patched"]
    assert "touches sys.modules" in flags["module_swapped"]
    assert "touches __code__" in flags["code_rewritten"] and "uses gc" in flags["code_rewritten"]
    assert "files handed in but not copied" in flags["fake_minidist"] and "minidist/checks" in flags["fake_minidist"]
    assert "named like the standard or installed module 'minidist'" in flags["fake_minidist"]
    assert "not confirmed" not in flags["honest1"] and "suspicious" not in flags["honest1"]


def test_the_answer_key_and_the_grader_are_out_of_reach(batch):
    if batch["meta"]["sandbox"].startswith("none"):
        pytest.skip("no sandbox on this machine: the answer key is readable (docs/INTEGRITY.md, Not guarded)")
    from autograder import REPO
    from autograder.course.cells import read_nb
    from autograder.course.hidden_tests import hidden_test_lines
    # the answer keys within reach of a kernel without a sandbox: this course's and the repository's
    # (notebooks of installed packages, e.g. nbgrader's own test files, are public)
    keys = [batch["source"]] + [read_nb(p) for p in sorted((REPO / "solutions").glob("*/*.ipynb"))]
    hidden = {line for nb in keys for line in hidden_test_lines(nb)}
    assert len(hidden) > 10
    for student in ("snoop", "vandal"):
        if student not in batch["bank"]:
            continue
        for f in (batch["out"] / "autograded" / student / LAB).glob("*.ipynb"):
            outputs = json.dumps([c.get("outputs", []) for c in json.loads(f.read_text())["cells"]])
            leaked = [line for line in hidden if json.dumps(line)[1:-1] in outputs]
            assert not leaked, (student, leaked[:3])


def test_sandbox_is_reported(batch):
    """Once for the batch (batch.json, the summary), on no row of results.csv."""
    assert json.loads((batch["out"] / "batch.json").read_text())["sandbox"] == batch["meta"]["sandbox"]
    assert not any(batch["meta"]["sandbox"] in str(v) for row in batch["rows"].values() for v in row.values())



def test_nothing_outside_the_sandbox_changes(batch):
    if batch["meta"]["sandbox"].startswith("none"):
        pytest.skip("no sandbox on this machine")
    before, after = batch["machine"]
    assert after == before
    nb = json.loads((batch["out"] / "autograded" / "root" / LAB / f"{LAB}.ipynb").read_text())
    said = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert said.count("refused ") == 6 and "wrote " not in said, said


def test_a_forged_verdict_is_refused_by_the_parent(batch):
    flags = {s: batch["rows"][(s, "test_add")]["flags"] for s in ("walk_stack", "signal_frame", "stdlib_name")}
    assert "answered out of turn" in flags["signal_frame"], flags      # reached the child's main(); refused
    assert "sys._getframe" in flags["walk_stack"] and "sys._getframe: os.py" in flags["stdlib_name"], flags
    # from a rank, with the test's nonce in flight: the runner's descriptors are closed in every fork
    assert batch["rows"][("rank_forge", "test_allsum")]["confirmed"].startswith("failed"), batch["rows"]


def test_a_program_left_running_by_a_solution_cell_is_killed_before_the_tests(batch):
    from autograder.sandbox.probe import probe
    if probe()[0] is None:
        pytest.skip("no sandbox here: the confirmation has no PID namespace of its own to sweep")
    flags = " ".join(row["flags"] for (student, _), row in batch["rows"].items() if student == "leaves_a_program")
    assert "a process left running by a solution cell (killed)" in flags, flags


def test_the_confirmation_watches_its_ranks_for_rebound_checks(batch):
    """What the confirmation saw is the instructor's (results.csv's ``confirmed``); the flag and the reason a
    student sees name the error's type only (the confirmation's child holds the hidden cases)."""
    row = batch["rows"][("rebinds_the_checks", "test_allsum")]
    said = row["confirmed"]
    assert "rebound " in said and "minidist.checks.kit.launch.TOL" in said and "launch.check_timeout" in said, row
    assert "not confirmed" in row["flags"] and row["points"] == "0.0", row
    assert "rebound " not in row["flags"] + row["reason"] and "its message is in the instructor's results" in row["reason"]


def test_library_answers_on_another_thread_or_under_another_name(batch):
    row = batch["rows"][("exec_library", "test_allsum")]
    assert row["points"] == "0.0" and "called minidist's own implementation: mine.ring_all_reduce" in row["reason"]
    assert batch["rows"][("thread_library", "test_allsum")]["points"] == "0.0"


def test_feedback_for_everyone_and_bounded(batch, tmp_path):
    from autograder.reports.feedback import collect
    made, leaks = collect(batch["out"], tmp_path / "handback")
    assert leaks and all("/hidden_quote/" in leak for leak in leaks), leaks[:3]
    assert {p.relative_to(tmp_path / "handback").parts[0] for p in made} == set(batch["bank"]) - {"hidden_quote"}
    html = (batch["out"] / "feedback" / "bloat" / LAB / f"{LAB}.html").read_text()
    assert "more outputs" in html and "cut by the autograder" in html and len(html) < 3_000_000, len(html)


def test_a_timeout_gets_a_second_chance(batch):
    row = batch["rows"][("slow_under_load", "test_allsum")]
    assert row["points"] == "2.0" and "passed when run again with timeouts x3" in row["flags"], row
