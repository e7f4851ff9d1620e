"""Shared helpers: configuration, the pinned kernel, labs, notebooks, template courses."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
from traitlets.config import Config, PyFileConfigLoader

from autograder import BUGBANK, CONFIG_FILE, KERNEL_NAME, LABS, SOLUTIONS

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"


# --------------------------------------------------------------------------- locations
def solutions_dir() -> Path:
    """solutions/ (or $MINIDIST_SOLUTIONS: tests point it at a fixture course)."""
    return Path(os.environ.get("MINIDIST_SOLUTIONS") or SOLUTIONS)


def labs_dir() -> Path:
    return Path(os.environ.get("MINIDIST_LABS") or LABS)


def bugbank_dir() -> Path:
    return Path(os.environ.get("MINIDIST_BUGBANK") or BUGBANK)


def ensure_venv_on_path() -> None:
    """nbgrader runs the `alembic` script when it creates a gradebook: make this
    interpreter's bin/ directory visible even when called as .venv/bin/python."""
    bindir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if bindir not in parts:
        os.environ["PATH"] = os.pathsep.join([bindir] + parts)


# --------------------------------------------------------------------------- config
def load_config(root: Path | None = None, db: Path | None = None, **overrides) -> Config:
    """The course configuration (autograder/nbgrader_config.py), optionally re-rooted.

    ``root``: a private course directory (source/, release/, submitted/ ... below it).
    """
    loader = PyFileConfigLoader(CONFIG_FILE.name, path=str(CONFIG_FILE.parent))
    c = loader.load_config()
    if root is not None:
        c.CourseDirectory.root = str(root)
        c.CourseDirectory.source_directory = "source"
        c.CourseDirectory.release_directory = "release"
        c.CourseDirectory.db_url = "sqlite:///" + str(Path(db or Path(root) / "gradebook.db"))
    for dotted, value in overrides.items():
        section, name = dotted.split("__")
        setattr(getattr(c, section), name, value)
    return c


def cell_timeout() -> int:
    return int(load_config().Execute.timeout)


def due_dates() -> dict[str, str]:
    """{lab: due date} from the course configuration (``c.Minidist.due_dates``)."""
    c = load_config()
    dates = c.Minidist.due_dates if "Minidist" in c and "due_dates" in c.Minidist else {}
    return {str(k): str(v) for k, v in dict(dates).items() if v}


# --------------------------------------------------------------------------- kernel
def kernel_argv() -> list[str]:
    """Make sure the pinned kernel exists and can import minidist; return its argv.

    Installs it into this interpreter's prefix when missing, i.e. runs
    ``python -m ipykernel install --sys-prefix --name minidist``.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    ksm = KernelSpecManager()
    try:
        spec = ksm.get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        spec = None
    if spec is None or not _kernel_ok(spec.argv):
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix",
                        "--name", KERNEL_NAME, "--display-name", "Python (minidist)"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ksm = KernelSpecManager()
        spec = ksm.get_kernel_spec(KERNEL_NAME)
        if not _kernel_ok(spec.argv):
            raise RuntimeError(f"kernel {KERNEL_NAME!r} ({spec.argv[0]}) cannot import minidist")
    return spec.argv


def _kernel_ok(argv) -> bool:
    exe = shutil.which(argv[0]) if argv else None
    if not exe:
        return False
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('minidist') and u.find_spec('ipykernel') else 1)")
    r = subprocess.run([exe, "-c", probe], capture_output=True)
    return r.returncode == 0


# --------------------------------------------------------------------------- labs
def all_labs(solutions: Path | None = None) -> list[str]:
    """Labs = directories solutions/<lab>/ that hold <lab>.ipynb."""
    solutions = solutions or solutions_dir()
    if not solutions.is_dir():
        return []
    return sorted(p.name for p in solutions.iterdir()
                  if p.is_dir() and (p / f"{p.name}.ipynb").is_file())


def lab_notebooks(lab: str, solutions: Path | None = None) -> list[str]:
    """Notebook names (without .ipynb) of a lab's source directory."""
    solutions = solutions or solutions_dir()
    return sorted(p.stem for p in (solutions / lab).glob("*.ipynb"))


def read_nb(path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def write_nb(nb, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def nbg(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def grade_id(cell):
    return nbg(cell).get("grade_id")


def strip_solution_markers(source: str) -> str:
    """The code a perfect student would type: solution markers removed, dedent kept."""
    return "\n".join(l for l in source.split("\n")
                     if BEGIN_SOLUTION not in l and END_SOLUTION not in l)


def hidden_test_lines(nb) -> list[str]:
    """Non-trivial source lines inside hidden-test regions of a source notebook."""
    out = []
    for cell in nb.cells:
        inside = False
        for line in cell.source.split("\n"):
            if BEGIN_HIDDEN in line:
                inside = True
            elif END_HIDDEN in line:
                inside = False
            elif inside and len(line.strip()) >= 8:
                out.append(line.strip())
    return out


def solution_submission(source_nb, release_nb):
    """A release notebook with every solution cell filled in from the source notebook."""
    sol = {grade_id(c): c for c in source_nb.cells if nbg(c).get("solution")}
    nb = json.loads(json.dumps(release_nb))  # deep copy
    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        gid = grade_id(cell)
        if gid in sol:
            cell.source = strip_solution_markers(sol[gid].source)
    return nb


# --------------------------------------------------------------------------- template course
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

    Runs ``nbgrader generate_assignment`` (through nbgrader's API) for each lab.
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
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
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
    points of its hidden tests (:mod:`autograder.test_parts`; 0 for a cell without any).
    """
    from nbgrader.api import Gradebook

    from autograder.test_parts import hidden_points

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
