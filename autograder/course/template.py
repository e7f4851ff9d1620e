"""A private nbgrader course made from the source labs (the *template* course): ``source/`` copied,
``release/`` and ``gradebook.db`` made by ``nbgrader generate_assignment``; nbgrader's converters run
on a course; a lab's graded cells as its gradebook lists them."""
from __future__ import annotations

import functools
import os
import shutil
import sys
import threading
from pathlib import Path

from autograder.course.cells import grade_id, read_nb
from autograder.course.config import load_config
from autograder.course.hidden_tests import hidden_points
from autograder.course.labs import BANK_FILE, solutions_dir


def ensure_venv_on_path() -> None:
    """nbgrader runs the `alembic` script when it creates a gradebook: make this
    interpreter's bin/ directory visible even when called as .venv/bin/python."""
    bindir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if bindir not in parts:
        os.environ["PATH"] = os.pathsep.join([bindir] + parts)


@functools.cache
def _alembic_head() -> str:
    """The revision nbgrader stamps into every new gradebook: the head of its own migration
    scripts, read here in-process (0.2 s). nbgrader asks the ``alembic`` command line for it in
    a subprocess, which takes about 5 s on the 2-core machines, once per new gradebook: that is,
    once per ``grade`` batch and per course built, for a constant."""
    import nbgrader
    from alembic.script import ScriptDirectory
    heads = ScriptDirectory(str(Path(nbgrader.__file__).parent / "alembic")).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"nbgrader's migrations have {len(heads)} heads: {heads}")
    return heads[0]


def build_course(labs: list[str], dest: Path, solutions: Path | None = None) -> Path:
    """A private nbgrader course: source/ (copied), release/ and gradebook.db (generated).

    Runs ``nbgrader generate_assignment`` (through nbgrader's API) for each lab. The lab's bug bank is
    never copied: nbgrader copies every other file of source/ into the release, and ``autograde`` into
    the folder a submission is graded in.
    """
    import nbgrader.api
    from nbgrader.converters import GenerateAssignment

    nbgrader.api.get_alembic_version = _alembic_head      # the gradebook it creates, stamped in-process
    ensure_venv_on_path()
    solutions = solutions or solutions_dir()
    dest = Path(dest)
    (dest / "source").mkdir(parents=True, exist_ok=True)
    for lab in labs:
        src = solutions / lab
        if not src.is_dir():
            raise FileNotFoundError(f"no such lab: {src}")
        shutil.copytree(src, dest / "source" / lab, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", BANK_FILE))
    c = load_config(root=dest)
    for lab in labs:
        r = run_converter(GenerateAssignment, c, lab, force=True, create_assignment=True)
        if not r["success"]:
            raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n"
                               f"{r.get('error', '')}\n{r.get('log', '')}")
    return dest


_CONVERTER_LOCK = threading.Lock()


def run_converter(cls, config, assignment_id: str, student_id: str | None = None, **attrs) -> dict:
    """Run one nbgrader converter (what ``nbgrader <command>`` runs) and capture its log.

    Same as nbgrader's NbGraderAPI methods, without importing nbgrader.apps (slow).
    Returns nbgrader's dict: success, log and possibly error.
    """
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.utils import capture_log

    coursedir = CourseDirectory(config=config)
    coursedir.assignment_id = assignment_id
    if student_id is not None:
        coursedir.student_id = student_id
    app = cls(coursedir=coursedir, config=config)
    for k, v in attrs.items():
        setattr(app, k, v)
    with _CONVERTER_LOCK:       # a converter chdirs into its course: one at a time per process
        return capture_log(app)


def lab_cells(course: Path, lab: str) -> dict[str, list[dict]]:
    """{notebook: [{name, max_score, kind}]} for the graded cells of a lab, in notebook order.

    kind: "test" (autograded code cell) or "manual" (a solution cell that is also graded); hidden: the
    points of its hidden tests (:mod:`autograder.course.hidden_tests`; 0 for a cell without any).
    """
    from nbgrader.api import Gradebook

    out = {}
    with Gradebook("sqlite:///" + str(Path(course) / "gradebook.db")) as gb:
        a = gb.find_assignment(lab)
        for nb in a.notebooks:
            rel = read_nb(Path(course) / "release" / lab / f"{nb.name}.ipynb")
            order = {grade_id(c): i for i, c in enumerate(rel.cells) if grade_id(c)}
            src = Path(course) / "source" / lab / f"{nb.name}.ipynb"
            source = {grade_id(c): c for c in read_nb(src).cells if grade_id(c)} if src.is_file() else {}
            solutions = {c.name for c in nb.solution_cells}
            cells = [{"name": gc.name, "max_score": float(gc.max_score),
                      "kind": "manual" if gc.name in solutions or gc.cell_type != "code" else "test",
                      "hidden": hidden_points(source[gc.name], float(gc.max_score))
                      if gc.name in source and gc.name not in solutions and gc.cell_type == "code" else 0.0}
                     for gc in nb.grade_cells]
            cells.sort(key=lambda d: order.get(d["name"], 10**9))
            out[nb.name] = cells
    return out
