"""docs/AUTHORING.md's worked example, done as it says: a copy of the grader, the library and the
fixture course grows the toy lab by one exercise with `python -m autograder new-exercise` and two files
the guide shows (the exercise's module, its hidden cases), then the solution and the bank, and the lab's
selftest passes. Before the blocks are written, the selftest reports the scaffold's stubs as unfinished.
What the scaffold writes is what the guide shows it writes, line for line.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "AUTHORING.md"


def examples(kind: str = "example") -> dict[str, str]:
    """{label: code} of the guide's blocks marked ``<!-- example: label -->`` (or ``scaffold``)."""
    text = GUIDE.read_text()
    return {m.group(1): m.group(2)
            for m in re.finditer(rf"<!-- {kind}: ([\w.]+) -->\n```python\n(.*?)```", text, re.S)}


def test_the_guide_shows_every_block_the_example_needs():
    # two files of the author's (the exercise, its hidden cases), then the notebook's solution and the bank
    assert set(examples()) == {"mul.py", "hidden.py", "solution", "bank"}
    assert set(examples("scaffold")) == {"__init__.py", "mul.py"}


@pytest.fixture
def copy(tmp_path):
    """The grader and the library copied (the scaffold writes into them), and the fixture course."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for part in ("minidist", "autograder"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=ignore)
    shutil.copytree(ROOT / "tests" / "fixtures" / "course", tmp_path / "course", ignore=ignore)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), MINIDIST_SOLUTIONS=str(tmp_path / "course" / "solutions"),
               MINIDIST_LABS=str(tmp_path / "labs"))
    return tmp_path, env


def _autograder(root: Path, env: dict, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autograder", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _lines_differ(got: str, want: str) -> list:
    return [(k + 1, g, w) for k, (g, w) in enumerate(zip(got.splitlines(), want.splitlines())) if g != w] or (
        [] if len(got.splitlines()) == len(want.splitlines()) else [("lines", len(got.splitlines()),
                                                                      len(want.splitlines()))])


def test_the_scaffold_writes_what_the_guide_shows(copy):
    """Line for line: the exercise's module, and what __init__.py gains."""
    root, env = copy
    init = root / "minidist" / "checks" / "toylab" / "__init__.py"
    before = init.read_text()
    r = _autograder(root, env, "new-exercise", "toylab", "mul", "--args", "a, b", "--points", "2", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    shown = examples("scaffold")
    written = (root / "minidist" / "checks" / "toylab" / "mul.py").read_text()
    assert not _lines_differ(written, shown["mul.py"]), _lines_differ(written, shown["mul.py"])
    after = init.read_text()
    assert after.startswith(before.rstrip("\n")), "the scaffold changed what __init__.py had"
    added = after[len(before.rstrip("\n")):].lstrip("\n")
    assert not _lines_differ(added, shown["__init__.py"]), _lines_differ(added, shown["__init__.py"])


def test_the_scaffold_names_the_check_in_all_where_the_lab_has_one():
    from autograder.handout.scaffold import with_all
    init = '"""A lab."""\n__all__ = ["CHECKS", "check_a"]\nCHECKS = None\n'
    assert with_all(init, "check_b") == '"""A lab."""\n__all__ = ["CHECKS", "check_a", "check_b"]\nCHECKS = None\n'
    assert with_all('"""A lab."""\n', "check_b") == '"""A lab."""\n'
    long = "__all__ = [" + ", ".join(f'"name_{k:02d}"' for k in range(12)) + "]\n"
    lines = with_all(long, "check_b").splitlines()
    assert len(lines) == 2 and all(len(line) <= 120 for line in lines) and lines[1].strip().endswith('"check_b"]')


@pytest.mark.timeout(900)
@pytest.mark.e2e        # about 45 s on 2 cores: `make test-e2e`, which `.ci/run` runs
def test_an_exercise_added_as_the_guide_says_passes_the_selftest(copy):
    root, env = copy
    r = _autograder(root, env, "new-exercise", "toylab", "mul", "--args", "a, b", "--points", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    checks = root / "minidist" / "checks" / "toylab"
    assert str(checks / "mul.py") in r.stdout and "bugbank" in r.stdout, r.stdout
    # the scaffold refuses a name the lab has already, before writing anything
    again = _autograder(root, env, "new-exercise", "toylab", "mul")
    assert again.returncode != 0 and "has an exercise 'mul' already" in again.stderr

    # the stubs: the selftest says what is unfinished, and the new test cell resolves through the registry
    r = _autograder(root, env, "selftest", "--lab", "toylab", "--quick", "--quiet")
    assert r.returncode != 0 and "unfinished" in r.stdout and "mul_bug_1" in r.stdout, r.stdout[-3000:]
    resolves = subprocess.run([sys.executable, "-c", (
        "from autograder.confirm.judge import resolve\n"
        "print([c.key for c, p in resolve('minidist.checks.toylab', 'check_mul', [None], {'hidden': True})])")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert "minidist.checks.toylab.mul" in resolves.stdout, resolves.stderr[-2000:]

    # the guide's two files: the exercise's module (in place of its skeleton), its hidden cases
    blocks = examples()
    (checks / "mul.py").write_text(blocks["mul.py"])
    hidden = checks / "hidden.py"
    hidden.write_text(hidden.read_text().rstrip("\n") + "\n" + blocks["hidden.py"])
    notebook = root / "course" / "solutions" / "toylab" / "toylab.ipynb"
    nb = nbformat.read(notebook, 4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "mul")
    assert cell.source.count('    raise NotImplementedError("write the solution")') == 1, cell.source
    cell.source = cell.source.replace('    raise NotImplementedError("write the solution")', blocks["solution"].rstrip("\n"))
    nbformat.write(nb, notebook)
    bank = root / "course" / "solutions" / "toylab" / "bugbank.py"
    text = bank.read_text()
    stub = text[text.index("\n# new exercise mul"):]
    bank.write_text(text.replace(stub, "\n" + blocks["bank"]))

    r = _autograder(root, env, "selftest", "--lab", "toylab", "--quick", "--quiet")
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-2000:])
    assert "mul_adds" in r.stdout and "mul_with_operator" in r.stdout, r.stdout[-3000:]
