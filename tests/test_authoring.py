"""docs/AUTHORING.md's worked example, done as it says: a copy of the grader, the library and the
fixture course grows the toy lab by one exercise with `python -m autograder new-exercise` and the code
blocks the guide shows (cases, answers, verdicts, the solution, the bank), and the lab's selftest passes.
Before the blocks are written, the selftest reports the scaffold's stubs as unfinished.
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


def examples() -> dict[str, str]:
    """{label: code} of the guide's blocks marked ``<!-- example: label -->``."""
    text = GUIDE.read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"<!-- example: ([\w.]+) -->\n```python\n(.*?)```", text, re.S)}


def test_the_guide_shows_every_block_the_example_needs():
    assert set(examples()) == {"cases.py", "hidden.py", "answers.py", "verdicts.py", "solution", "bank"}


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


def _fill(path: Path, stub: str, code: str) -> None:
    """Replace the scaffold's stub function(s) whose body raises ``stub`` by ``code``."""
    text = path.read_text()
    blocks = re.findall(r'\n\ndef \w+\((?:(?!\ndef ).)*?raise NotImplementedError\("new exercise mul: [^"]*"\)\n',
                        text, re.S)
    assert blocks, (path, stub)
    for block in blocks:
        text = text.replace(block, "")
    path.write_text(text.rstrip("\n") + "\n\n\n" + code)


@pytest.mark.timeout(900)
@pytest.mark.e2e        # about 45 s on 2 cores: `make test-e2e`, which `.ci/run` runs
def test_an_exercise_added_as_the_guide_says_passes_the_selftest(copy):
    root, env = copy
    r = _autograder(root, env, "new-exercise", "toylab", "mul", "--args", "a, b", "--points", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    checks = root / "minidist" / "checks" / "toylab"
    assert str(checks / "cases.py") in r.stdout and "bugbank" in r.stdout, r.stdout
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

    # the guide's blocks, each where the guide puts it
    blocks = examples()
    for name in ("cases.py", "answers.py", "verdicts.py"):
        _fill(checks / name, "mul", blocks[name])
    hidden = checks / "hidden.py"
    hidden.write_text(hidden.read_text().rstrip("\n") + "\n\n" + blocks["hidden.py"])
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
