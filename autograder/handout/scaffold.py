"""``python -m autograder new-exercise LAB NAME``: the skeleton of one more graded exercise.

An exercise is two files of the author's (docs/AUTHORING.md): its cases and verdict in one module of the
lab's checks folder, and its hidden cases in the lab's ``hidden.py``; its answer is the kit's ``called``
(what ``NAME(*case["args"])`` returned). This writes the rest, with the ids and the metadata nbgrader and
the grader need, and the skeleton of the first file:

* the lab's source notebook (``solutions/LAB/LAB.ipynb``): a markdown cell for the task, a solution
  cell ``def NAME(ARGS)`` with its solution markers, and a test cell that calls ``check_NAME`` on the
  visible cases and, between hidden-test markers, on the hidden ones; each with a fresh cell id;
* the exercise's module ``minidist/checks/LAB/NAME.py``: ``cases``, ``covered`` and ``verdict``, each
  raising NotImplementedError until written;
* in the lab's ``__init__.py``: its :class:`Check` (``CHECKS.exercise``) and the public ``check_NAME``,
  registered in the lab's ``CHECKS`` (the judge resolves the test cell through it), named in ``__all__``
  where the lab has one;
* the lab's bug bank (``solutions/LAB/bugbank.py``): three bugs and two correct alternatives
  marked ``unfinished``, which the selftest reports until they are written.

Nothing is overwritten: a name the lab already has is refused before anything is written.
``tests/test_authoring.py`` holds these templates equal, line for line, to what docs/AUTHORING.md shows.
"""
from __future__ import annotations

import ast
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
    init = (folder / "__init__.py").read_text()
    if {name, f"test_{name}"} & taken or f"def check_{name}(" in init or (folder / f"{name}.py").exists():
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
    (folder / f"{name}.py").write_text(exercise_module(lab, name, args, where))
    (folder / "__init__.py").write_text(with_all(init, f"check_{name}").rstrip("\n") + "\n" + registration(lab, name, args, where))
    _append(bank, _BANK.format(name=name))
    return [notebook, folder / f"{name}.py", folder / "__init__.py", bank]


def exercise_module(lab: str, name: str, args: str, where: str = "here") -> str:
    """The skeleton of the exercise's module ``<lab>/<name>.py``: its cases, its ✓ text, its verdict."""
    return _MODULE.format(lab=lab, name=name, args=args, answer=_WHERE_ANSWER[where])


def registration(lab: str, name: str, args: str, where: str = "here") -> str:
    """What ``__init__.py`` gets: the exercise's Check and its public check."""
    on_ranks = ', where="launch", world=lambda case: case["world_size"]' if where == "launch" else ""
    return _ENTRY.format(lab=lab, name=name, args=args, upper=name.upper(), on_ranks=on_ranks)


def with_all(init: str, public: str) -> str:
    """``init`` with ``public`` added to its ``__all__`` (a list of names), where it has one."""
    node = next((n for n in ast.parse(init).body if isinstance(n, ast.Assign) and len(n.targets) == 1
                 and getattr(n.targets[0], "id", None) == "__all__" and isinstance(n.value, ast.List)), None)
    if node is None:
        return init
    names = [ast.literal_eval(e) for e in node.value.elts] + [public]
    lines, line = [], "__all__ = ["
    for k, item in enumerate(names):
        piece = repr(item).replace("'", '"') + ("]" if k == len(names) - 1 else ",")
        if len(line) + 1 + len(piece) > 120:
            lines.append(line)
            line = " " * len("__all__ = [") + piece
        else:
            line += ("" if line.endswith("[") else " ") + piece
    lines.append(line)
    source = init.splitlines(keepends=True)
    before, after = "".join(source[:node.lineno - 1]), "".join(source[node.end_lineno:])
    return before + "\n".join(lines) + "\n" + after


def _append(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    path.write_text(old.rstrip("\n") + "\n" + text)


_WHERE_ANSWER = {"here": "in this process", "launch": "on every rank of a launch of case[\"world_size\"], a list by rank"}
_MODULE = '''\"\"\"The exercise ``{name}({args})`` of {lab}: its cases (the hidden ones are the grader's, in
``hidden.py``) and its verdict; the answer is the kit's ``called``, what ``{name}(*case["args"])`` returned
({answer}).\"\"\"
from __future__ import annotations

from minidist.checks.kit.withheld import hidden_cases


def cases(hidden: bool) -> list[dict]:
    \"\"\"The visible cases, and the hidden ones after them (``hidden_cases(__package__, "{name}")``): each a dict
    of plain values, ``args`` the arguments of the call; the verdict rebuilds what it compares with from it.\"\"\"
    raise NotImplementedError("new exercise {name}: list its cases (docs/AUTHORING.md)")


def covered(hidden: bool) -> str:
    \"\"\"What the ✓ line says a passing test covered: exactly the cases that ran.\"\"\"
    raise NotImplementedError("new exercise {name}: say what its cases cover (docs/AUTHORING.md)")


def verdict(case, answer) -> str | None:
    \"\"\"What is wrong with ``answer`` on ``case``, in words (None: nothing).\"\"\"
    raise NotImplementedError("new exercise {name}: judge an answer (docs/AUTHORING.md)")
'''
_ENTRY = '''

{upper} = CHECKS.exercise("{name}"{on_ranks})


@CHECKS.entry({upper})
def check_{name}(fn, *, hidden: bool = False) -> None:
    \"\"\"``{name}({args})``, on the cases of ``{name}.py`` (docs/AUTHORING.md).\"\"\"
'''
_BANK = '''
# new exercise {name} (python -m autograder new-exercise): the selftest reports these as unfinished
BUGS += [dict(name=f"{name}_bug_{{k}}", cell="{name}", code=None, catches=["test_{name}"],
              why="TODO: a mistake students make", unfinished=True) for k in (1, 2, 3)]
ALTERNATIVES += [dict(name=f"{name}_alternative_{{k}}", cell="{name}", code=None,
                      why="TODO: another correct way", unfinished=True) for k in (1, 2)]
'''
