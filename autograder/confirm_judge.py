"""The confirmation's judge: gives the judged checks' verdicts again in a process that never runs
student code (started by :mod:`autograder.confirm_parent` before the child runs any cell, as
``python -I confirm_judge.py``).

The child reports a test passed or failed; for a *judged* check (:mod:`minidist.checks.kit.docket`)
that report is not enough. With the child's reply comes the docket, the student's answers as
plain data; the parent hands it here with the test cell's id, and this process finds in the test
cell's source (the instructor's) which judged checks it calls and with which ``hidden``, takes
their cases from the pristine checks, computes the references and gives each verdict again. A
check with a case that has no answer fails. What the child can do to this process: send it data,
which is read as plain data only (no pickle, no code). It is not dumpable, from before the child
starts, so no process of the same uid can trace it or read its memory.

Which checks are judged is read from the checks module's source (a function decorated
``@judged(...)``), so a test cell that calls none costs no import of torch here.

Protocol (:mod:`autograder.confirm_wire` frames): first ``{path, cells}``, then ``{cell, docket}``
per test the child reported passed, each answered by ``{cell, problem, judged}``.
"""
import ast
import ctypes
import ctypes.util
import importlib
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import confirm_wire as wire  # noqa: E402


def checks_modules(setup_sources, path) -> dict:
    """{name in the notebook: (module, {names of its judged checks})} for every
    ``from minidist.checks import X as Y`` / ``import minidist.checks.X as Y`` of the lab's own cells."""
    out = {}
    for source in setup_sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "minidist.checks" and not node.level:
                names = [(f"minidist.checks.{a.name}", a.asname or a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [(a.name, a.asname) for a in node.names if a.name.startswith("minidist.checks.") and a.asname]
            for module, alias in names:
                judged = _judged_in_source(module, path)
                if judged:
                    out[alias] = (module, judged)
    return out


def _judged_in_source(module: str, path, seen=()) -> set:
    """The names of the judged checks ``module`` defines (``@judged(...)`` on a top-level ``def``) or
    takes by name from another module of minidist.checks (lab 3's checks re-export one)."""
    for root in path:
        file = os.path.join(root, *module.split(".")) + ".py"
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            judged = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                      and any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "judged"
                              for d in node.decorator_list)}
            for node in tree.body:
                if (isinstance(node, ast.ImportFrom) and not node.level and node.module
                        and node.module.startswith("minidist.checks.") and node.module not in seen):
                    theirs = _judged_in_source(node.module, path, (*seen, module))
                    judged |= {a.asname or a.name for a in node.names if a.name in theirs}
            return judged
    return set()


class NotConstant:
    """An argument the test cell does not give as a constant (the student's function, a variable)."""

    def __repr__(self):
        return "<not a constant>"


def _constant(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NotConstant()


def judged_calls(source: str, modules: dict) -> list:
    """(module, check name, positional arguments, keyword arguments) of every call of a judged check
    in a test cell's source; an argument that is not a constant is a :class:`NotConstant`."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in modules):
            continue
        module, judged = modules[node.func.value.id]
        if node.func.attr in judged:
            args = [NotConstant() if isinstance(a, ast.Starred) else _constant(a) for a in node.args]
            kwargs = {k.arg: _constant(k.value) for k in node.keywords if k.arg is not None}
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                kwargs["*"] = NotConstant()          # unpacked arguments: nothing can be read for sure
            calls.append((module, node.func.attr, args, kwargs))
    return calls


def verdict(calls, docket) -> str | None:
    """The first problem the judged checks find in the docket's answers, or None."""
    for module, name, args, kwargs in calls:
        check = getattr(importlib.import_module(module), name)
        if "*" in kwargs:
            return f"{name}: the judge cannot read the test cell's call (unpacked arguments)"
        try:
            bound = inspect.signature(check).bind(*args, **kwargs)
        except TypeError as err:
            return f"{name}: the test cell's call does not fit the check ({err})"
        bound.apply_defaults()
        for judged in check.judged:
            params = {p: bound.arguments[p] for p in judged.params}
            unread = [p for p, v in params.items() if isinstance(v, NotConstant)]
            if unread:
                return f"{judged.name}: the test cell does not give {', '.join(unread)} as a constant"
            problem = judged.judge(params, docket)
            if problem:
                return problem
    return None


def main():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)                  # PR_SET_DUMPABLE: before the child runs anything
    cmd, reply = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    spec = wire.recv(cmd)
    if not isinstance(spec, dict):
        os._exit(0)
    path = [str(p) for p in spec.get("path", [])]
    sys.path[:0] = path
    cells = spec.get("cells", [])
    modules = checks_modules([c["source"] for c in cells if c.get("kind") in ("setup", "given")], path)
    tests = {c["id"]: c["source"] for c in cells if c.get("kind") == "test"}
    for module in sorted({m for m, _ in modules.values()}):
        try:                 # now, while the child starts: the parent waits for each verdict
            importlib.import_module(module)
        except Exception:    # noqa: BLE001  (the same failure is the verdict of the tests that need it)
            pass
    while True:
        msg = wire.recv(cmd)
        if not isinstance(msg, dict):
            break
        cell, docket = msg.get("cell"), msg.get("docket")
        try:
            calls = judged_calls(tests.get(cell, ""), modules)
            problem = verdict(calls, docket if isinstance(docket, list) else []) if calls else None
        except Exception as err:      # noqa: BLE001  (the judge's own failure leaves the test unconfirmed)
            calls, problem = [], f"the judge failed: {type(err).__name__}: {err}"
        wire.send(reply, {"cell": cell, "problem": problem, "judged": [f"{m}.{n}" for m, n, *_ in calls]})
    os._exit(0)


if __name__ == "__main__":
    main()
