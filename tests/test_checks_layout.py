"""The grading kit's layout rules (issues 42 and 61), read from the code: a folder per lab with the same
kinds of files, verdicts that never read answers, no private name taken from another module, no re-exports,
one notebook-cell regex, one tensor comparison, and every public check registered."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "minidist" / "checks"
LABS = sorted(p.name for p in CHECKS.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "kit")
# the lab-wide files (a lab of exercises written one module each, the toy lab, has none of them)
FILES = {"cases.py", "answers.py", "verdicts.py"}
# hidden.py: the grader's hidden cases (kit/withheld.py); stand_ins.py: thin adapters over the library that stand
# in for the functions a test does not grade (labs 3, 9); given.py: lab 3's given classes;
# route.py: lab 9's Route, the type its notebook's dispatch returns; helpers.py, checkpoints.py: lab 10's, what it
# hands out and what its cases start from; faults.py: lab 10's, the failures its save cases inject and the files a
# load opens; restart_kit.py: lab 10's, what its restart exercise hands out (the step, the sampler, the store)
OPTIONAL = {"demo.py", "hidden.py", "stand_ins.py", "given.py", "route.py", "helpers.py",
            "checkpoints.py", "faults.py", "restart_kit.py"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imported(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from X import names`` and ``import X`` in ``path``, at any depth."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_every_lab_has_moved_into_a_folder():
    flat = sorted(p.name for p in CHECKS.glob("lab*.py"))
    assert not flat, f"checks outside a lab's folder: {flat}"
    assert {f"lab{n}" for n in range(1, 10)} <= {lab.split("_")[0] for lab in LABS}, LABS


def exercises(lab: str) -> list[str]:
    """The lab's exercise modules (docs/AUTHORING.md): one exercise's ``cases`` and its ``verdict`` (or the kit's:
    the toy lab's ``allsum`` is graded by kit/collectives.py) in one file."""
    out = []
    for path in sorted((CHECKS / lab).glob("*.py")):
        defined = {n.name for n in _tree(path).body if isinstance(n, ast.FunctionDef)}
        if path.name not in FILES | OPTIONAL | {"__init__.py"} and "cases" in defined:
            out.append(path.name)
    return out


@pytest.mark.parametrize("lab", LABS)
def test_a_labs_folder_holds_the_same_files(lab):
    """``__init__.py``; the lab-wide cases, answers and verdicts all three or none; the optional files named
    above; and exercise modules."""
    names = {p.name for p in (CHECKS / lab).glob("*.py")}
    assert "__init__.py" in names and (FILES <= names or not FILES & names), sorted(names)
    assert not names - FILES - OPTIONAL - {"__init__.py"} - set(exercises(lab)), sorted(names)
    assert FILES <= names or exercises(lab), f"{lab} has neither cases.py, answers.py, verdicts.py nor exercises"


@pytest.mark.parametrize("lab", LABS)
def test_verdicts_never_read_answers(lab):
    for name in ["verdicts.py"] * ("verdicts.py" in FILES & {p.name for p in (CHECKS / lab).glob("*.py")}) + \
            exercises(lab):
        for module, names in _imported(CHECKS / lab / name):
            bad = [f"{module}.{n}" if n else module for n in names or [""]
                   if re.search(rf"{lab}\.(answers|demo)\b|^{lab}$", f"{module}.{n}" if n else module)
                   or (module == f"minidist.checks.{lab}" and n in ("answers", "demo"))]
            assert not bad, f"{lab}/{name} imports {bad}"


def _modules():
    return sorted(p for p in CHECKS.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(CHECKS)))
def test_no_private_name_is_taken_from_another_module_and_nothing_is_re_exported(path):
    private = [f"{m}.{n}" for m, names in _imported(path) for n in names
               if n.startswith("_") and not n.startswith("__") and m.startswith("minidist")]
    assert not private, f"{path.relative_to(ROOT)} imports private names {private}"
    assert "noqa: F401" not in path.read_text(), f"{path.relative_to(ROOT)} re-exports (noqa: F401)"


def test_one_notebook_cell_regex():
    """minidist.protocol.NOTEBOOK_CELL is the one regex that recognises a notebook cell's file name."""
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "minidist").rglob("*.py")) + sorted(
        (ROOT / "autograder").rglob("*.py")) if re.search(r"ipykernel_(?!launcher)", p.read_text())
        and p.name != "protocol.py"]                   # ipykernel_launcher, the kernel's module, is no cell
    assert not found, found


def test_one_tensor_comparison():
    """Every lab compares tensors with kit.compare.tensor_error: no other module defines one."""
    others = []
    for path in _modules():
        if path.name == "compare.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in ("err", "tensor_error", "compare_tensors"):
                others.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not others, others


@pytest.mark.parametrize("lab", LABS)
def test_every_public_check_is_registered(lab):
    """Each public ``check_*`` of a lab's module is an entry of its registry, and runs Checks of that lab."""
    from minidist.checks.kit.check import Check, Registry
    module = importlib.import_module(f"minidist.checks.{lab}")
    registry = module.CHECKS
    assert isinstance(registry, Registry) and registry.lab == module.__name__
    public = {n for n in dir(module) if n.startswith("check_") and callable(getattr(module, n))}
    assert public == set(registry.entries), (public, set(registry.entries))
    for name, (_, checks, by) in registry.entries.items():
        listed = checks.values() if by is not None else [checks]
        for item in listed:
            for check in item if isinstance(item, tuple) else (item,):
                assert isinstance(check, Check) and check.lab == module.__name__, (name, check)
