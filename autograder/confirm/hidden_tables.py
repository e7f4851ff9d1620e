"""A lab's hidden case tables as the confirmation gets them: from the grader, never from a file.

The student's kernel must not be able to read a lab's hidden cases (it could print them into a visible
test's output), so the copy of minidist the jobs import leaves every ``minidist/checks/<lab>/hidden.py``
out (:func:`autograder.confirm.start.copy_pristine`). The confirmation, which scores the hidden tests,
gets the tables the lab's setup cells need in its spec, on the stdin of its parent, which hands them to
its judge and to its child; each of those serves them to its own imports (:func:`install`) under the
file name they would have in the pristine copy, so they are minidist's code to the audit hook and the
refusal, and no file of them exists in any sandbox. A submission observes of the hidden cases what its
own functions receive (their inputs), in the confirmation only, whose output nobody sees.

Grader side (:func:`tables`): a table is read from ``$MINIDIST_HIDDEN/<lab>/hidden.py`` (a platform's
bundle keeps them there, outside the library it installs) or from the grader's own minidist. Sandbox
side (:func:`checks_modules`, :func:`install`): standard library only, copied next to the pristine copy.
"""
import ast
import importlib.abc
import importlib.util
import os
import sys

#: a folder of ``<lab>/hidden.py``: where a platform's bundle keeps the tables (its library has none)
HIDDEN_DIR_ENV = "MINIDIST_HIDDEN"
CHECKS_PACKAGE = "minidist.checks."


def checks_modules(setup_sources) -> dict:
    """{name in the notebook: module name} for every ``from minidist.checks import X as Y`` /
    ``import minidist.checks.X as Y`` of the lab's own cells."""
    out = {}
    for source in setup_sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == CHECKS_PACKAGE[:-1] and not node.level:
                out.update({a.asname or a.name: CHECKS_PACKAGE + a.name for a in node.names})
            elif isinstance(node, ast.Import):
                out.update({a.asname: a.name for a in node.names if a.name.startswith(CHECKS_PACKAGE) and a.asname})
    return out


def table_file(module: str) -> str | None:
    """Grader side: the file of checks module ``module``'s hidden cases, or None (a lab without them)."""
    lab = module[len(CHECKS_PACKAGE):] if module.startswith(CHECKS_PACKAGE) else ""
    if not lab.isidentifier():
        return None
    places = [os.environ[HIDDEN_DIR_ENV]] if os.environ.get(HIDDEN_DIR_ENV) else []
    spec = importlib.util.find_spec(CHECKS_PACKAGE[:-1])       # the grader's own minidist
    places += list(spec.submodule_search_locations or []) if spec else []
    for place in places:
        path = os.path.join(place, lab, "hidden.py")
        if os.path.isfile(path):
            return path
    return None


def tables(setup_sources) -> dict:
    """Grader side: {``<checks module>.hidden``: source} for every checks module the lab's setup cells import."""
    out = {}
    for module in sorted(set(checks_modules(setup_sources).values())):
        path = table_file(module)
        if path is not None:
            with open(path, encoding="utf-8") as f:
                out[f"{module}.hidden"] = f.read()
    return out


class _Tables(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the hidden tables it was given, and nothing else, to this process's imports."""

    def __init__(self, sources: dict, root: str):
        self.sources, self.root = dict(sources), root

    def find_spec(self, name, path=None, target=None):
        if name not in self.sources:
            return None
        origin = os.path.join(self.root, *name.split(".")) + ".py"     # where the pristine copy would hold it
        spec = importlib.util.spec_from_loader(name, self, origin=origin)
        spec.has_location = True
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = module.__spec__.origin
        exec(compile(self.sources[module.__name__], module.__file__, "exec"), module.__dict__)


def install(sources, root: str) -> None:
    """Sandbox side: serve ``sources`` ({module: source}, plain strings only) as if they were files below
    ``root`` (the pristine copy's folder), first on the meta path."""
    clean = {k: v for k, v in (sources or {}).items() if isinstance(k, str) and isinstance(v, str)
             and k.startswith(CHECKS_PACKAGE) and k.endswith(".hidden")}
    if clean:
        sys.meta_path.insert(0, _Tables(clean, root))
