"""What the course hands out, searched for answers (issue 58): shared by ``test_student_dist.py`` (the student
distribution) and ``test_handed_out.py`` (the Gradescope and PrairieLearn bundles).

Two searches, each over every file of a folder (a wheel's members and a zip's too):

* **solution bodies**: every solution region of every lab's source notebook, as a block of its lines (each
  stripped of its indent), must not stand in any file, but in the library's own implementation of the
  lab's technique (a module of the library the lab refuses: a short formula, lab 6's merge of two partial
  attentions, is written the same way there), never in the checks;
* **functions named like an exercise**: a function or class a lab's notebook asks for (its solution cells'
  ``def``/``class`` names) may be defined, outside the released notebooks, only in the library's own
  implementation (a module of the library the lab's refusal refuses while graded code runs: calling it earns
  nothing, and a pasted copy is what the similarity report flags) or as a thin adapter over it (a few lines
  that call refused code: given or pasted as the answer, it earns nothing).

And one search for the bug banks (``solutions/<lab>/bugbank.py``), which hold working answers (every correct
alternative) and the mistakes the tests look for: no file named like a bank, no bank entry's name quoted, no
distinctive line of an entry's code (:func:`bank_in`).
"""
from __future__ import annotations

import ast
import importlib
import io
import runpy
import zipfile
from pathlib import Path

import nbformat

from autograder.course.cells import BEGIN_SOLUTION, END_SOLUTION, grade_id, nbg

ROOT = Path(__file__).resolve().parents[1]


def files(folder: Path) -> dict[str, bytes]:
    """{path below ``folder`` (a wheel's or a zip's members as ARCHIVE/member): its bytes}."""
    out = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        rel = str(path.relative_to(folder))
        if path.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(path) as z:
                for m in z.namelist():
                    data = z.read(m)
                    if m.endswith((".whl", ".zip")):
                        with zipfile.ZipFile(io.BytesIO(data)) as inner:
                            out.update({f"{rel}/{m}/{n}": inner.read(n) for n in inner.namelist()})
                    else:
                        out[f"{rel}/{m}"] = data
        else:
            out[rel] = path.read_bytes()
    return out


def _text(name: str, data: bytes) -> str:
    if name.endswith(".ipynb"):
        try:
            return "\n".join(c.source for c in nbformat.reads(data.decode(), as_version=4).cells)
        except Exception:      # noqa: BLE001  (not a notebook after all: its text)
            pass
    return data.decode("utf-8", "replace")


def _block(lines) -> str:
    return "\n".join(s for s in (line.strip() for line in lines) if s)


def solution_bodies() -> dict[str, str]:
    """{"lab/grade id #k": the k-th solution region's lines, stripped} of every lab, regions of 3 lines or more."""
    out = {}
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            if not nbg(cell).get("solution") or cell.cell_type != "code":
                continue
            regions, inside = [], None
            for line in cell.source.splitlines():
                if BEGIN_SOLUTION in line:
                    inside = []
                elif END_SOLUTION in line and inside is not None:
                    regions.append(inside)
                    inside = None
                elif inside is not None:
                    inside.append(line)
            for k, region in enumerate(regions):
                body = _block(region)
                if body.count("\n") >= 2:
                    out[f"{path.parent.name}/{grade_id(cell)} #{k}"] = body
    return out


def solutions_in(folder: Path) -> list[tuple[str, str]]:
    """(file, solution region) for every solution region of any lab that stands whole in a file of ``folder``
    other than a module of the library that lab refuses for that exercise."""
    bodies = solution_bodies()
    found = []
    for name, data in files(folder).items():
        text = _block(_text(name, data).splitlines())
        module = _module(name)
        for which, body in bodies.items():
            lab, cell = which.split(" #")[0].split("/")
            if body in text and not library_of(lab, module, cell):
                found.append((name, which))
    return found


def exercises() -> dict[str, set[str]]:
    """{lab: the names of the functions and classes its solution cells define}."""
    out = {}
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        names = out.setdefault(path.parent.name, set())
        for cell in nbformat.read(str(path), as_version=4).cells:
            if nbg(cell).get("solution") and cell.cell_type == "code":
                try:
                    tree = ast.parse(cell.source)
                except SyntaxError:
                    continue
                names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return out


def _module(member: str) -> str | None:
    """``minidist/x/y.py`` anywhere in a path -> ``minidist.x.y``; None for a file outside the package."""
    parts = member.split("/")
    if "minidist" not in parts or not member.endswith(".py"):
        return None
    parts = parts[parts.index("minidist"):]
    parts[-1] = parts[-1][:-3]
    return ".".join(p for p in parts if p != "__init__")


def library_of(lab: str, module: str | None, name: str) -> bool:
    """Whether ``module`` is the library's own implementation of ``lab``'s technique, refused while the
    exercise ``name`` is graded: a module of the library (never of the checks, whose copies of an answer
    are the defect this guards against) that the lab's refusal refuses."""
    return bool(module) and not module.startswith("minidist.checks.") and refused_by(lab, module, name)


def refused_by(lab: str, module: str, name: str) -> bool:
    """Whether ``lab``'s test of exercise ``name`` refuses ``module`` while graded code runs (the lab's
    REFUSED: one refusal, or one per exercise)."""
    refused = importlib.import_module(f"minidist.checks.{lab}").REFUSED
    refusal = refused.get(name) if isinstance(refused, dict) else refused
    return refusal is not None and any(module == m or module.startswith(m + ".") for m in refusal.modules)


#: (module, name): a function the library has under an exercise's name that is another function, no answer
NOT_THE_EXERCISE = {
    ("minidist.collectives.primitives", "all_to_all"): "lab 1's primitive all_to_all(tensor, group): chunks of one "
    "tensor to each rank, no dims, no autograd; lab 6's is a differentiable all_to_all(x, scatter_dim, gather_dim)",
}


def _imported(tree) -> dict[str, str]:
    """{local name: the module (or module.object) it was imported as} of a module's imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                        for a in node.names})
    return out


def thin_adapter(fn, imported: dict, lab: str) -> bool:
    """A function of at most three statements (its docstring aside) that calls into a module ``lab`` refuses:
    given or pasted as the answer for the exercise it stands in for, it calls refused code and earns nothing."""
    body = [n for n in fn.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if not isinstance(fn, ast.FunctionDef) or not 1 <= len(body) <= 3:
        return False
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            target = imported.get(root.id) if isinstance(root, ast.Name) else None
            if target and refused_by(lab, target, fn.name):
                return True
    return False


def exercises_defined_in(folder: Path) -> list[tuple[str, str, str]]:
    """(file, lab, name) for every function or class named like a lab's exercise that a Python file of
    ``folder`` defines, where that lab does not refuse the file's module and it is no thin adapter over
    refused code (nor a library function listed in :data:`NOT_THE_EXERCISE`)."""
    wanted = exercises()
    found = []
    for name, data in files(folder).items():
        if not name.endswith(".py"):
            continue
        try:
            tree = ast.parse(data.decode("utf-8", "replace"))
        except SyntaxError:
            continue
        imported, module = _imported(tree), _module(name)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or (module, node.name) in NOT_THE_EXERCISE:
                continue
            for lab, names in wanted.items():
                if node.name in names and not library_of(lab, module, node.name) \
                        and not thin_adapter(node, imported, lab):
                    found.append((name, lab, node.name))
    return found


# --------------------------------------------------------------------------- the bug banks
def fingerprint_lines(text: str) -> set[str]:
    """The lines of ``text`` distinctive enough to be a fingerprint (code and data, not punctuation)."""
    return {s for s in (line.strip() for line in text.splitlines())
            if len(s) >= 24 and not s.startswith(("#", '"""', "import ", "from ", "def ", "return "))}


def bank_files() -> list[Path]:
    """Every lab's bug bank, beside its solution."""
    return sorted((ROOT / "solutions").glob("*/bugbank.py"))


def bank_entries() -> tuple[set[str], set[str]]:
    """(the banks' bug and alternative names, their code's distinctive lines)."""
    names, lines = set(), set()
    for path in bank_files():
        bank = runpy.run_path(str(path))
        for entry in bank.get("BUGS", []) + bank.get("ALTERNATIVES", []):
            names.add(entry["name"])
            lines |= fingerprint_lines(entry.get("code") or "")
    return names, lines


def bank_in(folder: Path, public: set[str] = frozenset()) -> list[tuple[str, str]]:
    """(file, what) for every trace of a bug bank in ``folder``: a file named like one, a line of an entry's code
    (but the lines of ``public``, which students or the grader are meant to have), an entry's name quoted."""
    names, code = bank_entries()
    code = code - public
    found = []
    for name, data in files(folder).items():
        if name.rsplit("/", 1)[-1] == "bugbank.py" or "/bugbank/" in f"/{name}":
            found.append((name, "a bug bank's file"))
        text = _text(name, data)
        have = {line.strip() for line in text.splitlines()}
        found += [(name, f"a bank entry's line: {line}") for line in sorted(code & have)]
        found += [(name, f"a bank entry's name: {n}") for n in sorted(names) if f'"{n}"' in text or f"'{n}'" in text]
    return found


def public_lines() -> set[str]:
    """Every line something handed out may hold on purpose: the library (its hidden tables too, which a bundle's
    grader carries), the grader, the released labs, and the lab notebooks as a bundle carries them (without their
    solutions)."""
    from autograder.handout.platforms.bundle import without_solutions
    lines = set()
    for path in sorted((ROOT / "minidist").rglob("*.py")) + sorted((ROOT / "autograder").rglob("*.py")):
        lines |= {line.strip() for line in path.read_text().splitlines()}
    notebooks = [nbformat.read(str(p), as_version=4) for p in sorted((ROOT / "labs").glob("*/*.ipynb"))]
    notebooks += [without_solutions(nbformat.read(str(p), as_version=4))
                  for p in sorted((ROOT / "solutions").glob("*/*.ipynb"))]
    for nb in notebooks:
        lines |= {line.strip() for c in nb.cells for line in c.source.splitlines()}
    return lines
