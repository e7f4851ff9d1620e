"""The confirmation's judge: gives every test's verdict again in a process that never runs student
code (forked by :mod:`autograder.confirm.parent` before the child, :mod:`autograder.confirm.warm`;
``python -I confirm/judge.py`` runs it alone; standard library and minidist only).

The child reports a test passed or failed; that report is not enough. With the child's reply comes
the docket, the student's answers as plain data; the parent hands it here with the test cell's id.
This process reads the test cell's source (the instructor's) and resolves each of its calls through
the lab's registry of checks (``CHECKS`` in the lab's folder, :class:`minidist.checks.kit.check.Registry`):
which checks the call runs, with which params. It takes their cases from the pristine checks,
computes the references and gives each verdict again; a case with no answer fails.

It fails closed: a test cell that does anything but call registered checks of the lab's checks
module (an ``assert``, a variable, a call it cannot resolve, a param that is not a constant) cannot
be confirmed, and the test earns nothing. ``tests/test_judge.py`` proves every test cell of every lab
resolves. What the child can do to this process: send it data, which is read as plain data only (no
pickle, no code). It is not dumpable, from its start (before the child exists), so no process of
the same uid can trace it or read its memory.

Protocol (:mod:`autograder.confirm.wire` frames): first ``{path, cells, hidden}`` (``hidden``: the lab's
hidden case tables, :mod:`autograder.confirm.hidden_tables`), then ``{cell, docket}``
per test the child reported passed, each answered by ``{cell, problem, judged}``.
"""
import ast
import ctypes
import importlib
import os
import sys

# the folder holding autograder/confirm/ and minidist/ (the pristine copy; -I leaves it off the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from autograder.confirm import wire  # noqa: E402
from autograder.confirm.hidden_tables import checks_modules, install  # noqa: E402

class NotConstant:
    """An argument the test cell does not give as a constant (the student's function, a variable). A bare
    name keeps the name the cell gives (``__name__``): ``check_device(fn)`` picks its checks by it, as the
    call in the notebook picks them by the function's own name."""

    def __init__(self, name: str | None = None):
        if name is not None:
            self.__name__ = name

    def __repr__(self):
        return "<not a constant>"


def _constant(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NotConstant(node.id if isinstance(node, ast.Name) else None)


class Unresolved(Exception):
    """A test cell the judge cannot confirm: the test earns nothing."""


def test_calls(source: str, modules: dict) -> list:
    """(module, check function, positional arguments, keyword arguments) of every statement of a test
    cell, each of which must be a call of a check of the lab's checks module (comments aside);
    raises :class:`Unresolved` naming the first statement that is not. An argument that is not a
    constant is a :class:`NotConstant`."""
    try:
        body = ast.parse(source).body
    except SyntaxError as err:
        raise Unresolved(f"the test cell does not parse ({err.msg})") from None
    calls = []
    for node in body:
        call = node.value if isinstance(node, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id in modules):
            raise Unresolved(f"line {node.lineno} of the test cell is not a call of a check ({ast.unparse(node)[:80]})")
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            raise Unresolved(f"line {node.lineno} of the test cell unpacks its arguments")
        calls.append((modules[call.func.value.id], call.func.attr, [_constant(a) for a in call.args],
                      {k.arg: _constant(k.value) for k in call.keywords}))
    return calls


def resolve(module: str, name: str, args, kwargs) -> list:
    """(check, params) for every check a test cell's call runs, through the lab's registry."""
    registry = getattr(importlib.import_module(module), "CHECKS", None)
    if registry is None or name not in getattr(registry, "entries", {}):
        raise Unresolved(f"{name} is not one of {module}'s registered checks")
    try:
        found = registry.resolve(name, tuple(args), dict(kwargs))
    except (TypeError, ValueError) as err:
        raise Unresolved(f"{name}: the test cell's call does not fit the check ({err})") from None
    out = []
    for check, params, _graded in found:
        unread = [p for p, v in params.items() if isinstance(v, NotConstant)]
        if unread:
            raise Unresolved(f"{check.name}: the test cell does not give {', '.join(unread)} as a constant")
        out.append((check, params))
    return out


def verdict(source: str, modules: dict, docket) -> tuple[str | None, list]:
    """(the first problem with the test, or None; the checks judged). A test cell the judge cannot
    resolve is a problem: what cannot be confirmed earns nothing."""
    judged = []
    try:
        for module, name, args, kwargs in test_calls(source, modules):
            for check, params in resolve(module, name, args, kwargs):
                judged.append(check.key)
                problem = check.judge(params, docket)
                if problem:
                    return problem, judged
    except Unresolved as err:
        return f"the judge cannot confirm this test: {err}", judged
    if not judged:
        return "the judge cannot confirm this test: its cell calls no check", judged
    return None, judged


def main():
    libc = ctypes.CDLL(None, use_errno=True)
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
    install(spec.get("hidden"), path[0] if path else "")      # the hidden cases: from the grader, no file
    cells = spec.get("cells", [])
    modules = checks_modules([c["source"] for c in cells if c.get("kind") in ("setup", "given")])
    tests = {c["id"]: c["source"] for c in cells if c.get("kind") == "test"}
    for module in sorted(set(modules.values())):
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
            problem, judged = verdict(tests.get(cell, ""), modules, docket if isinstance(docket, list) else [])
        except Exception as err:      # noqa: BLE001  (the judge's own failure leaves the test unconfirmed)
            problem, judged = f"the judge failed: {type(err).__name__}: {err}", []
        wire.send(reply, {"cell": cell, "problem": problem, "judged": judged})
    os._exit(0)


if __name__ == "__main__":
    main()
