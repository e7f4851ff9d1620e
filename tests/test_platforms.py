"""Gradescope and PrairieLearn, end to end, on the fixture lab (tests/fixtures/course).

The zip is built, unpacked into a folder laid out like Gradescope's machine
(``ROOT/{source,submission,results}``, ROOT given by ``MINIDIST_GRADESCOPE_ROOT``), and its
``setup.sh`` runs: torch from the machine's local CPU wheel (found as the Makefile finds it), the
pinned requirements, minidist from the zip's wheel, the kernel. To keep the suite fast the
environment ``setup.sh`` installs into is seeded first with hard links of this test venv's
packages (minidist's excepted), so pip finds torch and nbgrader at the pinned versions already
installed and installs only the zip's minidist wheel and the kernel; a real machine downloads
them there. (A venv with ``--system-site-packages`` would see the interpreter's packages, not this
venv's, and packages reached through a ``.pth`` file are outside the sandbox: the grader refuses
them, rightly.) Then ``run_autograder`` grades the solution (full marks), the release (0), a bug of
the bank (loses the test it names), a submission that writes ``results.json`` itself (no effect),
and submissions that are not the lab's notebook; every ``results.json`` is validated against a
JSON schema of Gradescope's format. PrairieLearn's grader image is unpacked the same way (it shares
the environment: its ``setup.sh`` is the same file) and grades the same submissions. Every run's
output names the bundle (its record, ``bundle.json``, which ``--check`` finds up to date), and a
bundle that lacks its lab's notebook is the grader's failure: no score on either platform, exit
status 1, the cause on stdout.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import nbformat
import pytest

from autograder_fixtures import LAB, SOLUTIONS

pytestmark = [pytest.mark.timeout(1800),       # all gradings are in the first test's setup
              pytest.mark.e2e]               # about 2 minutes on 2 cores: `make test-e2e`, which `.ci/run` runs

VIS = ["hidden", "after_due_date", "after_published", "visible"]
FMT = ["text", "html", "simple_format", "md", "ansi"]
#: Gradescope's results.json (gradescope-autograders.readthedocs.io, "Autograder Specifications")
GRADESCOPE = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "score": {"type": "number"}, "execution_time": {"type": "number"}, "output": {"type": "string"},
        "output_format": {"enum": FMT}, "test_output_format": {"enum": FMT}, "test_name_format": {"enum": FMT},
        "visibility": {"enum": VIS}, "stdout_visibility": {"enum": VIS}, "extra_data": {"type": "object"},
        "leaderboard": {"type": "array"},
        "tests": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {"score": {"type": "number"}, "max_score": {"type": "number"},
                           "status": {"enum": ["passed", "failed"]}, "name": {"type": "string"},
                           "name_format": {"enum": FMT}, "number": {"type": "string"},
                           "output": {"type": "string"}, "output_format": {"enum": FMT},
                           "tags": {"type": "array", "items": {"type": "string"}},
                           "visibility": {"enum": VIS}, "extra_data": {"type": "object"}}}}},
    # the total, or a score on every test
    "anyOf": [{"required": ["score"]},
              {"required": ["tests"], "properties": {"tests": {"items": {"required": ["score"]}}}}],
}
#: PrairieLearn's external grader results (prairielearn.readthedocs.io, "External Grading")
PRAIRIELEARN = {
    "type": "object", "additionalProperties": False, "required": ["gradable"],
    "properties": {
        "succeeded": {"type": "boolean"}, "gradable": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "message": {"type": "string"},
        "output": {"type": "string"}, "images": {"type": "array"},
        "tests": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "points", "max_points"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                           "points": {"type": "number", "minimum": 0}, "max_points": {"type": "number", "minimum": 0},
                           "message": {"type": "string"}, "output": {"type": "string"},
                           "images": {"type": "array"}}}}},
    "if": {"properties": {"gradable": {"const": True}}}, "then": {"required": ["score"]},
}

#: a submission that writes the platform's results.json itself, at once and from a program it leaves
#: running (in a session of its own), to claim 1000 points; the test runs it without the sandbox (in
#: one, the results folder is not even there) so that the writes do happen, and leaves a mark
HOSTILE = r'''
import json, os, subprocess, sys
_fake = json.dumps({"score": 1000, "gradable": True, "tests": []})
for _p in PATHS:
    try:
        os.makedirs(os.path.dirname(_p), exist_ok=True)
        open(_p, "w").write(_fake)
        open(os.path.join(os.path.dirname(_p), "hostile-was-here"), "w").write("1")
        subprocess.Popen([sys.executable, "-c", "import sys, time\nfor _ in range(600):\n"
                          "    open(sys.argv[1], 'w').write(sys.argv[2])\n    time.sleep(0.05)", _p, _fake],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except Exception:
        pass
def add(a, b):
    return a + b
'''


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The fixture lab's solution, release, a bug and a hostile submission, as notebooks."""
    from autograder.course.cells import read_nb, solution_submission
    from autograder.course.template import build_course
    from autograder.selftest.bank import inject, load_bank
    old = {k: os.environ.get(k) for k in ("MINIDIST_SOLUTIONS",)}
    os.environ["MINIDIST_SOLUTIONS"] = str(SOLUTIONS)
    course = build_course([LAB], tmp_path_factory.mktemp("course") / "c")
    src = read_nb(course / "source" / LAB / f"{LAB}.ipynb")
    rel = read_nb(course / "release" / LAB / f"{LAB}.ipynb")
    sol = solution_submission(src, rel)
    bug = next(b for b in load_bank(LAB)["BUGS"] if b["name"] == "add_subtracts")
    yield {"solution": sol, "release": rel, "bug": inject(bug, {LAB: sol})[LAB], "catches": bug["catches"]}
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def unzip(zpath: Path, dest: Path) -> None:
    with zipfile.ZipFile(zpath) as z:
        for info in z.infolist():
            os.chmod(z.extract(info, dest), (info.external_attr >> 16) & 0o777 or 0o644)


def base_python() -> str:
    """The interpreter the platforms' environment is made with: one every uid can run where the machine
    has it (a grading container's python3; this machine's own may sit in root's private home), of this
    venv's version, so that its packages serve it."""
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (f"/usr/bin/{want}", f"/usr/local/bin/{want}"):
        if os.path.exists(exe):
            return exe
    return sys._base_executable


def seed_venv(venv: Path) -> None:
    """A venv holding hard links of this venv's packages (minidist's excepted), see the docstring."""
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    rel = Path(sysconfig.get_paths()["purelib"]).relative_to(sys.prefix)
    src = Path(sys.prefix) / rel
    subprocess.run(["cp", "-al", *[str(e) for e in src.iterdir() if "minidist" not in e.name], str(venv / rel)],
                   check=True)
    share = Path(sys.prefix) / "share" / "jupyter"          # nbconvert's templates; not the kernels
    (venv / "share" / "jupyter").mkdir(parents=True)
    subprocess.run(["cp", "-al", *[str(e) for e in share.iterdir() if e.name != "kernels"],
                    str(venv / "share" / "jupyter")], check=True)


@pytest.fixture(scope="module")
def installed(toy, request):
    """Gradescope's zip and PrairieLearn's image folder, built, unpacked and set up (one environment)."""
    from autograder.handout.platforms import gradescope, prairielearn
    from autograder.handout.platforms.version import check
    # a folder every uid may traverse, as Gradescope's /autograder and PrairieLearn's /minidist are: where no
    # sandbox works, a job runs as its own uid and must reach the environment (pytest's folders are 0700)
    tmp = Path(tempfile.mkdtemp(prefix="minidist-platforms-"))
    os.chmod(tmp, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    zpath = gradescope.build(LAB, tmp / "zip")
    assert zpath.name == f"{LAB}_autograder.zip"
    source = tmp / "gradescope-source"
    unzip(zpath, source)
    assert {p.name for p in source.iterdir()} >= {"setup.sh", "run_autograder", "wheels", "course", "requirements.txt",
                                                 "bundle.json"}
    assert not (source / "course" / "autograder" / "bugbank").exists()      # the bank's answers stay home
    assert (SOLUTIONS / LAB / "bugbank.py").is_file() and not list(source.rglob("bugbank.py"))
    pl = prairielearn.build(LAB, tmp / "pl", image="minidist-test/grader-toylab", timeout=300)
    image = pl / "grader-image"
    assert (image / "setup.sh").read_text() == (source / "setup.sh").read_text()    # one environment serves both
    info = json.loads((pl / "questions" / "minidist" / LAB / "info.json").read_text())
    assert info["gradingMethod"] == "External" and info["externalGradingOptions"] == {
        "enabled": True, "image": "minidist-test/grader-toylab", "entrypoint": "/minidist/run_prairielearn",
        "timeout": 300}
    assert "--wall-timeout 240 " in (image / "run_prairielearn").read_text()
    assert "--wall-timeout 540 " in (source / "run_autograder").read_text()
    for built in (zpath, pl):                   # each records the course it was built from: up to date here
        ok, text = check(LAB, built)
        assert ok and "up to date" in text, text
    seed_venv(source / "venv")
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != "MINIDIST_SOLUTIONS"}
    r = subprocess.run(["bash", str(source / "setup.sh")], capture_output=True, text=True, cwd=tmp,
                       env=dict(env, PYTHON=base_python()))
    assert r.returncode == 0 and "setup: ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert list((source / "venv").glob("lib/python*/site-packages/minidist-0.1.0.dist-info"))   # from the zip
    # PrairieLearn's image runs the same setup.sh in its Dockerfile: here, on the environment already made
    r = subprocess.run(["bash", str(image / "setup.sh")], capture_output=True, text=True, cwd=tmp,
                       env=dict(env, PYTHON=base_python(), MINIDIST_VENV=str(source / "venv")))
    assert r.returncode == 0 and "setup: ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    for folder in (source, image):       # setup.sh keeps the grader's files to root (the jobs' uids read nothing)
        if os.geteuid() == 0:
            assert (folder / "course").stat().st_mode & 0o077 == 0
    return {"source": source, "image": image, "tmp": tmp, "setup_s": time.time() - t0}


def submit(kind: str, installed, name: str, files: dict, env: dict | None = None, rc: int = 0) -> dict:
    """Lay out one submission on a fresh platform root, run the platform's entry point, return results.json
    (None where there is none). ``rc``: the exit status expected (1: the grader failed)."""
    root = installed["tmp"] / f"{kind}-{name}"
    sub = root / ("submission" if kind == "gradescope" else "student")
    sub.mkdir(parents=True)
    (root / "results").mkdir()
    for fname, content in files.items():
        if isinstance(content, bytes):
            (sub / fname).write_bytes(content)
        else:
            nbformat.write(content, str(sub / fname))
    if kind == "gradescope":
        (root / "source").symlink_to(installed["source"])      # Gradescope unpacks the zip at ROOT/source
        shutil.copy(installed["source"] / "run_autograder", root / "run_autograder")
        argv, var = [str(root / "run_autograder")], "MINIDIST_GRADESCOPE_ROOT"
    else:
        argv, var = [str(installed["image"] / "run_prairielearn")], "MINIDIST_PRAIRIELEARN_ROOT"
    venv = installed.get("venv") or installed["source"] / "venv"
    environ = dict(os.environ, **{var: str(root)}, MINIDIST_VENV=str(venv), **(env or {}))
    t0 = time.time()
    r = subprocess.run(argv, capture_output=True, text=True, env=environ, cwd=root)
    assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-3000:]
    time.sleep(0.5)                      # anything of the submission still alive would write now
    path = root / "results" / "results.json"
    data = json.loads(path.read_text()) if path.exists() else None
    if data is not None:
        jsonschema.validate(data, GRADESCOPE if kind == "gradescope" else PRAIRIELEARN)
    return {"data": data, "root": root, "stdout": r.stdout, "seconds": time.time() - t0}


#: a submission whose ``add`` reads every file it can reach (its folder, its home, the grader's folders in
#: /tmp, the interpreter's packages, the platform's root; the rest of this machine's /tmp is other people's
#: business, not the grader's) for the lab's solution code and its hidden case table, and says what it
#: found in the visible test's output (the error it raises there); the markers are written reversed, so
#: that the submission itself holds neither
PROBE = r'''
import os, sys
_MARKS = {"solution code": MARK_SOLUTION[::-1], "hidden case table": MARK_HIDDEN[::-1]}
_found = []
def _walk():
    mine = [os.path.join("/tmp", d) for d in os.listdir("/tmp") if d.startswith("minidist-")]   # the grader's
    roots = ROOTS + [os.getcwd(), os.path.expanduser("~"), sys.prefix] + mine + [p for p in sys.path if p]
    seen, hits, n = set(), [], 0
    for root in roots:
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x not in ("proc", "sys", "dev", "__pycache__")]
            for f in files:
                p = os.path.join(d, f)
                real = os.path.realpath(p)
                if real in seen or f.endswith((".so", ".pyc", ".a")):
                    continue
                seen.add(real)
                try:
                    if os.path.getsize(p) > 1 << 20:
                        continue
                    with open(p, "rb") as fh:
                        data = fh.read().decode("utf-8", "replace")
                except OSError:
                    continue
                n += 1
                hits += [f"{what} in {p}" for what, mark in _MARKS.items() if mark in data]
    return n, hits
def add(a, b):
    if not _found:
        _found.append(_walk())
    n, hits = _found[0]
    raise RuntimeError(f"PROBE read {n} files; found: {hits[:3]}")
'''
MARK_SOLUTION = "dist.all_reduce(y)\n    return y"         # the lab's allsum, as its source notebook solves it
MARK_HIDDEN = "lengths 5 and 1 in fp64"                      # a line of the lab's hidden case table


@pytest.fixture(scope="module")
def graded(toy, installed):
    """Every submission on both platforms, two at a time."""
    def hostile(kind):
        root = installed["tmp"] / f"{kind}-hostile"
        nb = nbformat.from_dict(json.loads(json.dumps(toy["solution"])))
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "add")
        cell.source = HOSTILE.replace("PATHS", repr([str(root / "results" / "results.json")]))
        return nb
    cases = {"solution": {f"{LAB}.ipynb": toy["solution"]}, "release": {f"{LAB}.ipynb": toy["release"]},
             "bug": {f"{LAB}.ipynb": toy["bug"]}}
    jobs = [(k, name, files, None) for k in ("gradescope", "prairielearn") for name, files in cases.items()]
    jobs += [(k, "hostile", {f"{LAB}.ipynb": hostile(k)}, {"MINIDIST_SANDBOX": "off"})
             for k in ("gradescope", "prairielearn")]
    def probe(kind):
        nb = nbformat.from_dict(json.loads(json.dumps(toy["release"])))       # the release: no solution of its own
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "add")
        roots = [str(installed["tmp"])]
        cell.source = (PROBE.replace("MARK_SOLUTION", repr(MARK_SOLUTION[::-1]))
                       .replace("MARK_HIDDEN", repr(MARK_HIDDEN[::-1]))
                       .replace("ROOTS", repr(roots)))
        return {f"{LAB}.ipynb": nb}
    jobs += [("gradescope", "probe", probe("gradescope"), None), ("prairielearn", "probe", probe("prairielearn"), None),
             ("gradescope", "probe-nosandbox", probe("gradescope"), {"MINIDIST_SANDBOX": "missing"})]
    jobs += [("gradescope", "notjson", {f"{LAB}.ipynb": b'{"cells": [oops'}, None),
             ("gradescope", "nonotebook", {"answer.py": b"def add(a, b):\n    return a + b\n"}, None),
             ("prairielearn", "several", {"a.ipynb": toy["solution"], "b.ipynb": toy["release"]}, None)]
    t0 = time.time()
    with ThreadPoolExecutor(2) as pool:
        futs = {(k, name): pool.submit(submit, k, installed, name, files, env) for k, name, files, env in jobs}
        out = {key: f.result() for key, f in futs.items()}
    out["seconds"] = time.time() - t0
    return out


def gs_tests(run) -> dict:
    return {t["name"].split(": ")[-1]: t for t in run["data"]["tests"]}


def test_gradescope_solution_full_marks_release_zero(graded):
    sol, rel = graded[("gradescope", "solution")], graded[("gradescope", "release")]
    assert sol["data"]["score"] == 3.0 and rel["data"]["score"] == 0.0
    assert all(t["status"] == "passed" and t["score"] == t["max_score"] for t in sol["data"]["tests"])
    assert all(t["status"] == "failed" and t["score"] == 0 for t in rel["data"]["tests"])
    # each test cell has hidden tests: its visible part is shown at once, its hidden part after the due date
    # (the zip's defaults), each with half of the cell's points
    seen = {t["name"]: (t["visibility"], t["max_score"]) for t in sol["data"]["tests"]}
    assert seen == {f"{LAB}: test_add": ("visible", 0.5), f"{LAB}: test_add (hidden tests)": ("after_due_date", 0.5),
                    f"{LAB}: test_allsum": ("visible", 1.0),
                    f"{LAB}: test_allsum (hidden tests)": ("after_due_date", 1.0)}
    assert "confirmation run on" in sol["data"]["output"] and "sandbox: " in sol["data"]["output"]
    assert rel["data"]["tests"][0]["output"].startswith("NotImplementedError")
    # the instructor's output (stdout) and the stored extra data name the bundle it was graded with
    fingerprint = sol["data"]["extra_data"]["bundle"]["fingerprint"]
    assert f"bundle: {LAB}, fingerprint {fingerprint[:12]}, built " in sol["stdout"]
    assert graded[("prairielearn", "solution")]["stdout"].startswith(f"bundle: {LAB}, fingerprint ")


def test_gradescope_bug_loses_the_test_it_names(graded, toy):
    tests = gs_tests(graded[("gradescope", "bug")])
    assert toy["catches"] == ["test_add"]
    assert tests["test_add"]["score"] == 0 and tests["test_add"]["status"] == "failed"
    assert tests["test_add (hidden tests)"]["score"] == 0 and tests["test_add (hidden tests)"]["status"] == "failed"
    assert tests["test_add (hidden tests)"]["output"].startswith("hidden tests: ")
    assert tests["test_allsum"]["score"] == 1 and tests["test_allsum"]["status"] == "passed"
    assert tests["test_allsum (hidden tests)"]["score"] == 1


def test_hostile_results_write_has_no_effect(graded):
    for kind in ("gradescope", "prairielearn"):
        run = graded[(kind, "hostile")]
        assert (run["root"] / "results" / "hostile-was-here").exists(), "the attack never ran"
        data = json.loads((run["root"] / "results" / "results.json").read_text())
        assert data == run["data"]              # nothing wrote after the grader
        if kind == "gradescope":
            assert data["score"] == 3.0 and len(data["tests"]) == 4
        else:
            assert data["score"] == 1.0 and data["gradable"] and len(data["tests"]) == 4
        assert "sandbox: none" in json.dumps(data)      # and it says it ran without one


def test_gradescope_what_is_not_the_notebook(graded):
    bad = graded[("gradescope", "notjson")]["data"]
    assert bad["score"] == 0 and len(bad["tests"]) == 4
    assert all("not a readable notebook" in t["output"] for t in bad["tests"])
    none = graded[("gradescope", "nonotebook")]["data"]
    assert none["score"] == 0 and len(none["tests"]) == 4
    assert "no notebook was handed in (found: answer.py)" in none["output"]
    assert f"upload {LAB}.ipynb" in none["tests"][0]["output"]


def test_prairielearn_results(graded, toy):
    runs = {name: graded[("prairielearn", name)]["data"] for name in ("solution", "release", "bug", "several")}
    assert runs["solution"]["score"] == 1.0 and runs["solution"]["gradable"]
    assert [(t["points"], t["max_points"]) for t in runs["solution"]["tests"]] == [(0.5, 0.5)] * 2 + [(1.0, 1.0)] * 2
    assert runs["release"]["score"] == 0.0 and runs["release"]["gradable"]
    bug = {t["name"].split(": ")[-1]: t for t in runs["bug"]["tests"]}
    assert bug["test_add"]["points"] == 0 and bug["test_add (hidden tests)"]["points"] == 0
    assert bug["test_allsum"]["points"] == 1 and bug["test_allsum (hidden tests)"]["points"] == 1
    assert runs["bug"]["score"] == pytest.approx(2 / 3)
    assert not runs["several"]["gradable"] and "2 notebooks were handed in" in runs["several"]["message"]


def test_a_bundle_without_its_lab_fails_as_the_grader_not_as_a_score(toy, installed):
    """The lab's notebook taken out of a copy of each installed bundle (the environment is shared): the
    grader fails before grading; Gradescope gets no results.json, PrairieLearn a failed job."""
    tmp = installed["tmp"]
    copies = {"gradescope": tmp / "broken-source", "prairielearn": tmp / "broken-image"}
    shutil.copytree(installed["source"], copies["gradescope"], ignore=shutil.ignore_patterns("venv"), symlinks=True)
    shutil.copytree(installed["image"], copies["prairielearn"], symlinks=True)
    for copy in copies.values():
        gone = list((copy / "course").rglob(f"{LAB}.ipynb"))
        assert gone
        for nb in gone:
            nb.unlink()
    broken = dict(installed, source=copies["gradescope"], image=copies["prairielearn"],
                  venv=installed["source"] / "venv")
    files = {f"{LAB}.ipynb": toy["solution"]}
    gs = submit("gradescope", broken, "nolab", files, rc=1)
    assert gs["data"] is None                                   # Gradescope: "the autograder failed"
    assert f"{LAB}: THE GRADER FAILED (not the submission's fault): no lab {LAB}" in gs["stdout"]
    assert f"bundle: {LAB}, fingerprint " in gs["stdout"]
    pl = submit("prairielearn", broken, "nolab", files, rc=1)
    assert pl["data"]["succeeded"] is False and pl["data"]["gradable"] is False and "score" not in pl["data"]
    assert f"no lab {LAB}" in pl["stdout"] and "not your submission" in pl["data"]["message"]


@pytest.mark.parametrize("kind, name", [("gradescope", "probe"), ("gradescope", "probe-nosandbox"),
                                        ("prairielearn", "probe")])
def test_a_submission_reads_no_answer_while_graded(graded, installed, kind, name):
    """What a submission can read while it is graded holds neither the lab's solution code nor its hidden
    case table: with the sandbox, and where none works (a root grader's job then runs as its own uid, and
    the bundle's course folder is root's alone). The probe says in its visible test's output how many
    files it read and what it found there; the markers are really in the bundle (checked first)."""
    run = graded[(kind, name)]
    tests = {t["name"].split(": ")[-1]: t for t in run["data"]["tests"]}
    shown = tests["test_add"]["output"] if kind == "gradescope" else tests["test_add"]["message"]
    said = re.search(r"PROBE read (\d+) files; found: (\[.*?\])", shown)     # the check adds the case and line
    assert said and said.group(2) == "[]", shown
    assert int(said.group(1)) > 100, shown      # it did read the folders it reached
    assert (("sandbox: none" in json.dumps(run["data"])) == name.endswith("nosandbox"))
    bundle = installed["source" if kind == "gradescope" else "image"] / "course"
    texts = "".join(p.read_text(errors="replace") for p in bundle.rglob("*") if p.is_file())
    assert MARK_HIDDEN in texts                       # the bundle holds the hidden table, for the grader alone
    assert "dist.all_reduce(y)" not in texts          # and no solution at all
