"""One verdict contract and one public API in every lab (issue 61), read from every lab's registry:

* every Check's verdict is called ``verdict(case, answer)`` and returns ``str | None``: its signature has
  those two parameters and nothing bound around it, and on its first visible case a deliberately wrong
  answer gets a problem (a string; or an exception, which the Check turns into one), never None or a list;
* every public check function is ``check_<function>(fn, *, ...)`` (``check_<function>_<aspect>`` for a further
  test of it), keyword-only options, ``hidden=False``, no timeout (the Check has it); every lab with device
  checks has one ``check_device(fn)``, which picks them by the graded function's name;
* every Check is named after a test cell of its lab's notebook that runs it (its grade_id without ``test_``,
  and a word more for a second Check of the same cell), a device check after its base Check (``" device"``).
"""
from __future__ import annotations

import functools
import importlib
import inspect
from pathlib import Path

import nbformat
import pytest

from autograder.confirm import judge
from minidist.checks.kit.check import BY_NAME, Check, snake
from minidist.checks.kit.device_check import META

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(p.name for p in (ROOT / "minidist" / "checks").iterdir()
              if (p / "__init__.py").exists() and p.name != "kit")
#: a lab's notebook: the source notebook, or the fixture's for the toy lab
NOTEBOOKS = {lab: ROOT / "solutions" / lab / f"{lab}.ipynb" for lab in LABS if lab != "toylab"} | {
    "toylab": ROOT / "tests" / "fixtures" / "course" / "solutions" / "toylab" / "toylab.ipynb"}


def _registry(lab):
    return importlib.import_module(f"minidist.checks.{lab}").CHECKS


def _checks():
    return [(lab, check) for lab in LABS for check in _registry(lab).checks.values()]


def _visible(check: Check) -> dict:
    return {p: False for p in check.params if p == "hidden"}


def _wrong(check: Check, item):
    """An answer no verdict may pass: nothing, from every rank where the verdict reads every rank's."""
    return [None] * check.world(item) if check.where == "launch" else None


@pytest.mark.parametrize("lab, check", _checks(), ids=[f"{lab}-{c.name}" for lab, c in _checks()])
def test_every_verdict_is_verdict_case_answer_returning_a_problem_or_none(lab, check):
    verdict = check.verdict
    assert not isinstance(verdict, functools.partial), f"{check.key}: a verdict bound with partial"
    params = list(inspect.signature(verdict).parameters.values())
    assert len(params) == 2 and all(p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params), \
        f"{check.key}: verdict{inspect.signature(verdict)}, not verdict(case, answer)"
    item = check.judged_cases(_visible(check))[0]
    try:
        problem = verdict(item, _wrong(check, item))
    except Exception:     # noqa: BLE001  (an answer it cannot read: the Check says so, below)
        problem = "raised"
    assert isinstance(problem, str) and problem, f"{check.key}: {problem!r} for a wrong answer"
    found = check.found(item, _wrong(check, item))
    assert isinstance(found, str) and found, (check.key, found)


@pytest.mark.parametrize("lab", LABS)
def test_every_public_check_has_the_one_shape(lab):
    registry = _registry(lab)
    functions = {c.function for c in registry.checks.values()}
    for name, (stub, checks, by) in registry.entries.items():
        params = list(inspect.signature(stub).parameters.values())
        assert params[0].name == "fn" and params[0].kind == params[0].POSITIONAL_OR_KEYWORD, (name, params)
        assert all(p.kind == p.KEYWORD_ONLY for p in params[1:]), (name, params)
        assert all(p.default is False for p in params if p.name == "hidden"), name
        assert "timeout" not in {p.name for p in params}, f"{name}: the Check has the timeout"
        if name == "check_device":
            assert len(params) == 1 and by == BY_NAME, f"{lab}: check_device{inspect.signature(stub)}"
            assert all(c.default_device == META for group in checks.values() for c in group)
        else:
            assert any(name == f"check_{snake(f)}" or name.startswith(f"check_{snake(f)}_") for f in functions), \
                f"{name} is named after none of {lab}'s graded functions {sorted(functions)}"
    for function in functions:
        assert f"check_{snake(function)}" in registry.entries, f"{lab}: no check_{snake(function)}"
    devices = [c for c in registry.checks.values() if c.default_device == META]
    assert bool(devices) == ("check_device" in registry.entries), lab
    if devices:
        stub, by_function, _ = registry.entries["check_device"]
        assert {c.key for group in by_function.values() for c in group} == {c.key for c in devices}
        assert all(c.function == f for f, group in by_function.items() for c in group)


def _runs(lab) -> dict[str, set]:
    """{Check name: the grade ids of the test cells that run it}, through the judge's reading of the cells."""
    modules = {"checks": f"minidist.checks.{lab}"}
    out: dict[str, set] = {}
    for cell in nbformat.read(NOTEBOOKS[lab], 4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        for module, name, args, kwargs in judge.test_calls(cell.source, modules):
            for check, _ in judge.resolve(module, name, args, kwargs):
                out.setdefault(check.name, set()).add(meta["grade_id"])
    return out


@pytest.mark.parametrize("lab", LABS)
def test_every_check_is_named_after_a_test_cell_that_runs_it(lab):
    runs, checks = _runs(lab), _registry(lab).checks
    for name, check in checks.items():
        assert runs.get(name), f"{lab}: no test cell runs the check {name!r}"
        if check.default_device == META:
            base = name.removesuffix(" device")
            assert name.endswith(" device") and base in checks and checks[base].default_device is None, name
        else:
            stems = {gid.removeprefix("test_") for gid in runs[name]}
            assert name.split(" ")[0] in stems, f"{lab}: {name!r} is named after none of the cells {sorted(runs[name])}"
            assert len(name.split(" ")) <= 2, name


def test_a_device_check_is_picked_by_the_name_the_cell_passes():
    """The judge reads the graded function's name from the test cell as the run reads it from the function."""
    lab1 = importlib.import_module("minidist.checks.lab1_collectives")
    (call,) = judge.test_calls("checks.check_device(ring_all_reduce)\n", {"checks": lab1.__name__})
    (check, params), = judge.resolve(*call)
    assert check.name == "ring_all_reduce_correct device" and params == {}

    def ring_all_reduce(x):
        return x

    def mine(x):
        return x
    (check, _, graded), = lab1.CHECKS.resolve("check_device", (ring_all_reduce,), {})
    assert check.name == "ring_all_reduce_correct device" and graded is ring_all_reduce
    with pytest.raises(ValueError, match="has no check of 'mine'"):
        lab1.CHECKS.resolve("check_device", (mine,), {})
