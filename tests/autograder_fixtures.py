"""Helpers for the autograder tests: the fixture course and broken submissions."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from nbformat.v4 import new_code_cell

FIXTURE = Path(__file__).parent / "fixtures" / "course"
SOLUTIONS = FIXTURE / "solutions"
LAB = "toylab"

# grading limits used by the tests: the fixture's launch timeout is 4 s
CELL_TIMEOUT = 10
WALL = 120


def cell(nb, gid):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == gid)


def set_code(nb, gid, code):
    nb = copy.deepcopy(nb)
    cell(nb, gid).source = code
    return nb


def with_cell(nb, code, after="setup"):
    """A copy of ``nb`` with a code cell inserted after the cell whose grade id is ``after``."""
    nb = copy.deepcopy(nb)
    i = next(k for k, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == after)
    nb.cells.insert(i + 1, new_code_cell(code))
    return nb


def broken_class(solution, release, source=None) -> dict:
    """{student: notebook | bytes | None}: bytes are written raw, None = no notebook. ``source``: the
    lab's source notebook, handed in as it is by "fromsource"."""
    sol = solution
    subs = {
        "sol1": sol, "sol2": copy.deepcopy(sol), "sol3": copy.deepcopy(sol),
        "release": release,
        "deadlock": set_code(sol, "allsum",
                             "def allsum(x):\n    y = x.clone()\n    other = 1 - dist.get_rank()\n"
                             "    dist.recv(y, other)\n    dist.send(x, other)\n    return x + y"),
        "infloop": set_code(sol, "add", "while True:\n    pass\ndef add(a, b):\n    return a + b"),
        "sysexit": set_code(sol, "add", "import sys\nsys.exit(3)\ndef add(a, b):\n    return a + b"),
        "osexit": set_code(sol, "allsum", "import os\nos._exit(0)"),
        "sigkill": set_code(sol, "add", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"),
        "segfault": set_code(sol, "allsum", "import ctypes\nctypes.string_at(0)"),
        "bigoutput": set_code(sol, "add", 'print(("x" * 1000 + "\\n") * 3000)\nprint("y" * 2_000_000)\n'
                                          "def add(a, b):\n    return a + b"),
    }
    nb = copy.deepcopy(sol)
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "test_add"]
    subs["deleted_test"] = nb
    nb = copy.deepcopy(sol)
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "allsum"]
    subs["deleted_solution"] = nb
    nb = copy.deepcopy(sol)
    cell(nb, "add").metadata["nbgrader"]["grade_id"] = "my_add"
    subs["renamed"] = nb
    nb = set_code(sol, "add", "def add(a, b):\n    return a - b")
    cell(nb, "test_add").source = "assert True  # tests removed"
    cell(nb, "test_add").metadata["nbgrader"]["points"] = 100
    subs["tampered"] = nb
    subs["missing"] = None
    subs["wrongname"] = ("toylab-Copy1.ipynb", sol)
    subs["corrupt"] = json.dumps(sol)[:500].encode()
    if source is not None:
        subs["fromsource"] = copy.deepcopy(source)
    return subs


def write_class(root: Path, subs: dict) -> Path:
    import nbformat
    for student, nb in subs.items():
        d = root / student / LAB
        d.mkdir(parents=True, exist_ok=True)
        name = f"{LAB}.ipynb"
        if isinstance(nb, tuple):
            name, nb = nb
        if nb is None:
            (d / "README.txt").write_text("forgot the notebook")
        elif isinstance(nb, bytes):
            (d / name).write_bytes(nb)
        else:
            nbformat.write(nb, str(d / name))
    return root
