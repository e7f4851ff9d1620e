"""``python -m autograder new-exercise LAB NAME``: the skeleton of one more graded exercise.

Adding an exercise touches four places (docs/AUTHORING.md walks through it). This writes them all,
with the ids and the metadata nbgrader and the grader need, so an instructor fills in content only:

* the lab's source notebook (``solutions/LAB/LAB.ipynb``): a markdown cell for the task, a solution
  cell ``def NAME(ARGS)`` with its solution markers, and a test cell that calls ``check_NAME`` on the
  visible cases and, between hidden-test markers, on the hidden ones; each with a fresh cell id;
* the lab's checks folder (``minidist/checks/LAB/``): ``NAME_cases`` and ``NAME_covered`` in
  ``cases.py``, the answer in ``answers.py``, the verdict in ``verdicts.py`` (each raising
  NotImplementedError until written), and in ``__init__.py`` the :class:`Check` and the public
  ``check_NAME`` registered in the lab's ``CHECKS`` (the judge resolves the test cell through it);
* the lab's bug bank (``solutions/LAB/bugbank.py``): three bugs and two correct alternatives
  marked ``unfinished``, which the selftest reports until they are written.

Nothing is overwritten: a name the lab already has is refused before anything is written.
"""
from __future__ import annotations

import importlib.util
import re
import uuid
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from autograder.course.cells import grade_id, read_nb, write_nb
from autograder.course.labs import bank_file, solutions_dir

WHERE = ("here", "launch")


def _nbgrader(gid: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": gid, "locked": locked, "schema_version": 3, "solution": solution,
            "task": False}
    if grade:
        meta["points"] = points
    return {"nbgrader": meta}


def checks_folder(lab: str) -> Path:
    """The lab's checks folder, where ``minidist.checks.LAB`` is imported from."""
    spec = importlib.util.find_spec(f"minidist.checks.{lab}")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"no checks folder for {lab}: minidist/checks/{lab}/ (docs/AUTHORING.md, adding a lab)")
    return Path(list(spec.submodule_search_locations)[0])


def _alias(nb, lab: str) -> str:
    """The name the notebook's locked cells give the lab's checks module (``checks``)."""
    for cell in nb.cells:
        m = re.search(rf"from minidist\.checks import {lab} as (\w+)|import minidist\.checks\.{lab} as (\w+)",
                      cell.source if cell.cell_type == "code" else "")
        if m:
            return m.group(1) or m.group(2)
    raise SystemExit(f"the notebook of {lab} never imports its checks (from minidist.checks import {lab} as checks)")


def new_exercise(lab: str, name: str, *, args: str = "x", points: int = 2, where: str = "here",
                 after: str | None = None) -> list[Path]:
    """Write the skeleton of exercise ``name`` of ``lab`` (see the module's docstring); the files written."""
    if not name.isidentifier():
        raise SystemExit(f"{name!r} is not a Python name: the exercise is a function of that name")
    if where not in WHERE:
        raise SystemExit(f"--where must be one of {', '.join(WHERE)}")
    notebook = solutions_dir() / lab / f"{lab}.ipynb"
    bank = bank_file(lab)
    folder = checks_folder(lab)
    if not notebook.is_file():
        raise SystemExit(f"no source notebook {notebook}")
    nb = read_nb(notebook)
    taken = {grade_id(c) for c in nb.cells if grade_id(c)}
    if {name, f"test_{name}"} & taken or f"def check_{name}(" in (folder / "__init__.py").read_text():
        raise SystemExit(f"{lab} has an exercise {name!r} already")
    alias = _alias(nb, lab)
    cells = [
        new_markdown_cell(f"### `{name}`\n\nTODO: what `{name}({args})` does, what it is given and returns, where "
                          f"its tensors live, and the rules the test checks.",
                          metadata=_nbgrader(f"{name}_task", locked=True)),
        new_code_cell(f'def {name}({args}):\n    """TODO: one line on what it returns."""\n    ### BEGIN SOLUTION\n'
                      f'    raise NotImplementedError("write the solution")\n    ### END SOLUTION',
                      metadata=_nbgrader(name, solution=True)),
        new_code_cell(f"{alias}.check_{name}({name})\n### BEGIN HIDDEN TESTS\n{alias}.check_{name}({name}, hidden=True)\n"
                      f"### END HIDDEN TESTS", metadata=_nbgrader(f"test_{name}", grade=True, locked=True, points=points)),
    ]
    for cell in cells:
        cell["id"] = uuid.uuid4().hex[:8]
    at = len(nb.cells) if after is None else next(
        (i + 1 for i, c in enumerate(nb.cells) if grade_id(c) == after), None)
    if at is None:
        raise SystemExit(f"no cell {after!r} in {notebook}")
    nb.cells[at:at] = cells
    write_nb(nb, notebook)
    _append(folder / "cases.py", _CASES.format(name=name))
    _append(folder / "answers.py", _ANSWER.format(name=name, where=where))
    _append(folder / "verdicts.py", _VERDICT.format(name=name, where=where))
    init = (folder / "__init__.py").read_text()
    refusal = ", refusal=REFUSED" if re.search(r"^REFUSED\b", init, re.M) else ""
    on_ranks = ', where="launch", world=lambda case: case["world_size"]' if where == "launch" else ""
    _append(folder / "__init__.py", _ENTRY.format(name=name, upper=name.upper(), refusal=refusal, on_ranks=on_ranks,
                                                  indent=" " * len(f"{name.upper()} = CHECKS.check(")))
    _append(bank, _BANK.format(name=name))
    return [notebook, folder / "cases.py", folder / "answers.py", folder / "verdicts.py", folder / "__init__.py", bank]


def _append(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    path.write_text(old.rstrip("\n") + "\n" + text)


_CASES = '''

def {name}_cases(hidden: bool) -> list:
    """The cases of check_{name}: the visible ones, and more when hidden (each a tuple or a dict of
    plain values: the verdict rebuilds everything it compares with from it)."""
    raise NotImplementedError("new exercise {name}: list its cases (docs/AUTHORING.md)")


def {name}_covered(hidden: bool) -> str:
    """What the ✓ line says a passing test covered: exactly the cases that ran."""
    raise NotImplementedError("new exercise {name}: say what its cases cover (docs/AUTHORING.md)")
'''
_ANSWER = '''

def {name}(fn, case):
    """What the student's ``{name}`` did on ``case`` ({where}), as plain data (numbers, tensors, lists, dicts)."""
    raise NotImplementedError("new exercise {name}: run the student's function on a case (docs/AUTHORING.md)")
'''
_VERDICT = '''

def {name}(case, answer) -> str | None:
    """What is wrong with the answer to ``case`` ({where}: None when nothing is), rebuilt from the case alone."""
    raise NotImplementedError("new exercise {name}: judge an answer (docs/AUTHORING.md)")
'''
_ENTRY = '''

{upper} = CHECKS.check("{name}", cases.{name}_cases, answers.{name}, verdicts.{name}{refusal},
{indent}covered=cases.{name}_covered{on_ranks})


@CHECKS.entry({upper})
def check_{name}({name}, hidden: bool = False) -> None:
    """TODO: what check_{name} proves (the test cell's contract)."""
'''
_BANK = '''
# new exercise {name} (python -m autograder new-exercise): the selftest reports these as unfinished
BUGS += [dict(name=f"{name}_bug_{{k}}", cell="{name}", code=None, catches=["test_{name}"],
              why="TODO: a mistake students make", unfinished=True) for k in (1, 2, 3)]
ALTERNATIVES += [dict(name=f"{name}_alternative_{{k}}", cell="{name}", code=None,
                      why="TODO: another correct way", unfinished=True) for k in (1, 2)]
'''
