"""The student distribution (``python -m autograder student-dist``, issue 46): built once into a
temporary folder, its files listed and searched for the answer key, its wheel installed into a fresh
virtual environment where lab 1's visible check passes with the solution's code and fails with the
release's, and where ``hidden=True`` stops, before any launch, with one line naming the grader."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder.course.cells import BEGIN_SOLUTION, END_SOLUTION
from autograder.handout import student_dist, wheel
from handed_out import bank_entries, bank_files, bank_in, fingerprint_lines
from test_platforms import seed_venv

ROOT = Path(__file__).resolve().parents[1]
LAB = "lab1_collectives"


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    return student_dist.build(tmp_path_factory.mktemp("student") / "dist")


def _cells(path: Path) -> list:
    return nbformat.read(str(path), as_version=4).cells


def _texts(out: Path) -> dict[str, str]:
    """{path in the distribution (a wheel's members as wheel/member): its text}; notebooks as their cells' sources."""
    texts = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = str(path.relative_to(out))
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as z:
                texts.update({f"{rel}/{m}": z.read(m).decode("utf-8", "replace") for m in z.namelist()})
        elif path.suffix == ".ipynb":
            texts[rel] = "\n".join(c.source for c in _cells(path))
        else:
            texts[rel] = path.read_text()
    return texts


def _public_lines() -> set[str]:
    """Every line students are meant to have: the library (less the hidden tables) and the released labs."""
    hidden = set(wheel.hidden_tables())
    lines = set()
    for path in (ROOT / "minidist").rglob("*.py"):
        if path not in hidden:
            lines |= {line.strip() for line in path.read_text().splitlines()}
    for nb in (ROOT / "labs").glob("*/*.ipynb"):
        lines |= {line.strip() for c in _cells(nb) for line in c.source.splitlines()}
    return lines


def _solution_lines() -> set[str]:
    out = set()
    for nb in (ROOT / "solutions").glob("*/*.ipynb"):
        for cell in _cells(nb):
            inside = False
            for line in cell.source.splitlines():
                inside = (inside or BEGIN_SOLUTION in line) and END_SOLUTION not in line
                if inside:
                    out |= fingerprint_lines(line)
    return out


def test_the_distribution_holds_labs_a_wheel_and_a_readme_and_no_answer_key(dist):
    out = dist["readme"].parent
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    labs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "labs").rglob("*") if p.is_file())
    assert files == sorted(labs + ["README.md", f"wheels/{dist['wheel'].name}"]), files
    assert dist["wheel"].name == "minidist-0.1.0-py3-none-any.whl"
    members = zipfile.ZipFile(dist["wheel"]).namelist()
    assert {m.split("/")[0] for m in members} == {"minidist", "minidist-0.1.0.dist-info"}, "only the library"
    assert "minidist/checks/kit/withheld.py" in members and "minidist/checks/lab1_collectives/cases.py" in members
    assert not [m for m in members if m.endswith("hidden.py")], "a lab's hidden cases in the wheel"
    described = zipfile.ZipFile(dist["wheel"]).read("minidist-0.1.0.dist-info/METADATA").decode()
    assert student_dist.WHEEL_README in described and "make test" not in described, \
        "the wheel describes itself to students, not as the instructors' repository"
    assert len(wheel.hidden_tables()) >= 11          # labs 1-10 and the toy lab: the grader has them

    texts, public = _texts(out), _public_lines()
    hidden = set().union(*(fingerprint_lines(p.read_text()) for p in wheel.hidden_tables())) - public
    solution = _solution_lines() - public
    names, bank = bank_entries()      # every lab's bank: solutions/<lab>/bugbank.py
    bank -= public
    # each fingerprint set is large, so a leak of any of them would be found
    assert len(hidden) > 60 and len(solution) > 200 and len(bank) > 200 and len(names) > 100
    lines = {path: {line.strip() for line in text.splitlines()} for path, text in texts.items()}
    for what, needles in (("hidden case", hidden), ("solution", solution), ("bug bank", bank)):
        leaks = [(path, n) for path, have in lines.items() for n in needles & have]
        assert not leaks, f"{what} lines in the distribution: {leaks[:5]}"
    leaks = [(path, n) for path, text in texts.items() for n in names if f'"{n}"' in text or f"'{n}'" in text]
    assert not leaks, f"bug bank names in the distribution: {leaks[:5]}"
    assert len(bank_files()) >= 10 and bank_in(out, public) == []       # nor a bank's file, wheel included
    readme = dist["readme"].read_text()
    for said in (f"pip install wheels/{dist['wheel'].name}", "minidist doctor", "minidist lab copy", "grader"):
        assert said in readme


def test_the_distribution_holds_no_solution_body_and_no_exercise_but_the_librarys(dist):
    """Issue 58: no solution region of any lab stands whole in a file students get, and no function named
    like an exercise is defined there but in the library's own implementation (refused while graded code
    runs; a pasted copy is what the similarity report flags) or as a thin adapter over it."""
    from handed_out import exercises_defined_in, solutions_in
    out = dist["readme"].parent
    assert solutions_in(out) == []
    assert exercises_defined_in(out) == []
    assert not [m for m in zipfile.ZipFile(dist["wheel"]).namelist() if m.startswith("minidist/checks/")
                and m.endswith("/reference.py")]


CHECK = textwrap.dedent("""
    import json, sys, time
    import minidist
    import minidist.checks.kit.run as run
    assert "site-packages" in minidist.__file__, minidist.__file__
    cells = json.load(open(sys.argv[1]))
    ns = {}
    exec(compile(cells["setup"] + "\\n" + cells["sendrecv"] + "\\n" + cells["broadcast"], "cells", "exec"), ns)
    checks = ns["checks"]
    if sys.argv[2] == "hidden":
        def no_launch(*args, **kwargs):
            raise AssertionError("a rank was launched")
        run.launch_named = no_launch
        try:
            checks.check_broadcast(ns["broadcast"], hidden=True)
        except Exception as err:
            print(json.dumps({"type": type(err).__name__, "message": str(err)}))
        sys.exit(0)
    if sys.argv[2] == "all":         # every lab's visible cases build here, and none of the hidden ones
        import importlib, pkgutil
        import minidist.checks as C
        from minidist.checks.kit.withheld import HiddenTestsInGrader
        seen = 0
        for m in pkgutil.iter_modules(C.__path__):
            if m.name == "kit":
                continue
            lab = importlib.import_module("minidist.checks." + m.name)
            for stub, chosen, by in lab.CHECKS.entries.values():
                for c in (chosen.values() if isinstance(chosen, dict) else [chosen]):
                    for check in (c if isinstance(c, tuple) else (c,)):
                        if check.params != ("hidden",):
                            continue
                        assert check.judged_cases({"hidden": False})
                        assert check.covered is None or check.covered(hidden=False)
                        try:
                            check.judged_cases({"hidden": True})
                            raise SystemExit(check.key + ": hidden cases built")
                        except HiddenTestsInGrader:
                            seen += 1
        print(json.dumps({"checks": seen}))
        sys.exit(0)
    checks.check_broadcast(ns["broadcast"])
""")


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A fresh venv with this venv's packages (hard links, minidist's excepted) and the student wheel."""
    where = tmp_path_factory.mktemp("venv")
    seed_venv(where / "venv")
    py = where / "venv" / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        "--disable-pip-version-check", str(dist["wheel"])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (where / "check.py").write_text(CHECK)
    return {"python": py, "dir": where}


def _code(nb: Path) -> dict[str, str]:
    """{grade_id: source} of the cells lab 1's broadcast check needs."""
    return {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in _cells(nb)
            if c.metadata.get("nbgrader", {}).get("grade_id") in ("setup", "sendrecv", "broadcast")}


def _run(venv, cells: dict, mode: str) -> subprocess.CompletedProcess:
    path = venv["dir"] / f"cells_{mode}.json"
    path.write_text(json.dumps(cells))
    return subprocess.run([str(venv["python"]), str(venv["dir"] / "check.py"), str(path), mode],
                          capture_output=True, text=True, cwd=venv["dir"], timeout=240)


def test_the_wheel_runs_lab1s_visible_check(venv):
    r = subprocess.run([str(venv["python"]), "-c", "import autograder"], capture_output=True, text=True,
                       cwd=venv["dir"])
    assert r.returncode != 0 and "No module named 'autograder'" in r.stderr
    solution = _run(venv, _code(ROOT / "solutions" / LAB / f"{LAB}.ipynb"), "visible")
    assert solution.returncode == 0 and "✓" in solution.stdout, solution.stdout[-2000:] + solution.stderr[-2000:]
    release = _run(venv, _code(ROOT / "labs" / LAB / f"{LAB}.ipynb"), "visible")
    assert release.returncode != 0 and "NotImplementedError" in release.stdout + release.stderr, \
        release.stdout[-2000:] + release.stderr[-2000:]


def test_hidden_tests_say_in_one_line_that_they_run_in_the_grader(venv):
    r = _run(venv, _code(ROOT / "solutions" / LAB / f"{LAB}.ipynb"), "hidden")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    err = json.loads(r.stdout.strip().splitlines()[-1])
    assert err["type"] == "HiddenTestsInGrader", err
    assert "\n" not in err["message"] and "hidden tests run in the grader" in err["message"]
    assert err["message"].startswith("broadcast: "), err["message"]


def test_every_labs_visible_cases_build_from_the_wheel_and_no_hidden_ones(venv):
    r = _run(venv, {"setup": "", "sendrecv": "", "broadcast": "import minidist.checks.lab1_collectives as checks"},
             "all")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["checks"] > 30


def _hidden_checks():
    """Every registered check of every lab that takes ``hidden``."""
    import importlib
    import pkgutil

    import minidist.checks as C
    out = []
    for m in pkgutil.iter_modules(C.__path__):
        if m.name != "kit":
            for stub, chosen, by in importlib.import_module(f"minidist.checks.{m.name}").CHECKS.entries.values():
                for c in (chosen.values() if isinstance(chosen, dict) else [chosen]):
                    out += [k for k in (c if isinstance(c, tuple) else (c,)) if k.params == ("hidden",) and k not in out]
    return out


def test_the_grader_still_has_every_labs_hidden_cases():
    """The repository (the grader's) keeps them: every check's hidden cases build and differ from its visible ones."""
    checks = _hidden_checks()
    assert len(checks) > 30
    for check in checks:
        assert repr(check.judged_cases({"hidden": True})) != repr(check.judged_cases({"hidden": False})), check.key


def test_lab_copy_works_in_the_distributions_folder(dist, venv, tmp_path):
    """The student README's `minidist lab copy N DEST`, run in the folder that holds labs/, makes the
    folder its next line opens in Jupyter."""
    readme = dist["readme"].read_text()
    number = re.search(r"minidist lab copy (\d+) ~/minidist-work\n", readme).group(1)
    opened = re.search(r"jupyter lab ~/minidist-work/(\S+)\n", readme).group(1)
    assert (number, opened) == ("1", LAB)
    r = subprocess.run([str(venv["python"].parent / "minidist"), "lab", "copy", number, str(tmp_path / "work")],
                       capture_output=True, text=True, cwd=dist["readme"].parent, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    copied = tmp_path / "work" / opened / f"{LAB}.ipynb"
    assert copied.read_bytes() == (ROOT / "labs" / LAB / f"{LAB}.ipynb").read_bytes()
