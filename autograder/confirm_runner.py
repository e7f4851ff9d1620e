"""The confirmation run: a submission's graded tests again, in a fresh interpreter that student
code did not prepare (started by :mod:`autograder.confirm`, inside the sandbox, as
``python -I confirm_runner.py``; it imports nothing from the autograder but its sibling).

What it runs, in notebook order: the lab's own setup and given cells (locked cells, from the
instructor's source notebook), the student's solution cells (the only student code that enters),
and the test cells with their hidden tests (from the source notebook). Notebook cells the
student added or changed outside the solution cells never run here.

What it guards:

* pristine bindings (:mod:`autograder.confirm_bindings`, its sibling): recorded once the setup
  cells have imported minidist's checks and torch; a change made by the solution cells is put
  back before the tests and reported, a change found after a test fails that test;
* an audit hook, installed before anything else and impossible to remove from Python: it
  refuses, when called from student code, ``ctypes``, the garbage collector's object graph,
  frame and code introspection, ``sys.settrace``/``setprofile`` (which would switch off the
  refusal of library answers), new audit hooks, and assigning ``__code__`` or attributes of
  minidist's and torch's classes; file access outside the working folder is reported;
* the report channel: results go to a file descriptor the student code does not know, each
  line carrying a token it cannot read.

Protocol: a JSON spec on stdin (``token``, ``path``, ``cells`` [{id, kind, source}],
``timeout``, ``workdir``); JSON lines on the inherited descriptor named by ``--fd``.
"""
import ast
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
import types

# the runner's sibling (copied next to it with the pristine minidist; -I leaves its folder off the path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from confirm_bindings import EMPTY, Snapshot  # noqa: E402

_local = threading.local()
_events: list = []             # (event, detail) reported to the grader as flags
_STUDENT_PREFIX = "<solution "
_BLOCK = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof", "ctypes.call_function",
          "ctypes.string_at", "ctypes.wstring_at", "ctypes.create_string_buffer", "ctypes.PyObj_FromPtr",
          "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe", "sys.settrace",
          "sys.setprofile", "sys.addaudithook", "sys._current_frames", "function.__new__", "code.__new__",
          "object.__getattr__"}
_FLAG = {"open", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "socket.connect", "os.remove",
         "os.rename", "shutil.rmtree", "os.chmod"}
_NARROW = ("sys.", "gc.", "object.__getattr__", "function.__new__", "code.__new__")
_FILE_EVENTS = {"open", "os.remove", "os.rename", "shutil.rmtree", "os.chmod"}
_OWNED = ("minidist", "torch")


_STUDENT_FILES: tuple = ()      # the working folder: files handed in next to the notebook are student code


def _is_student(filename: str) -> bool:
    return filename.startswith(_STUDENT_PREFIX) or (bool(_STUDENT_FILES) and filename.startswith(_STUDENT_FILES))


import sysconfig  # noqa: E402

_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + "/" for k in ("stdlib", "platstdlib")} |
                {sysconfig.get_paths()[k] + "/" for k in ("stdlib", "platstdlib")})


_INSPECT = tuple(p + "inspect.py" for p in _STDLIB)
_CTYPES = tuple(p + "ctypes/" for p in _STDLIB)


def _student_caller(event):
    """The student frame that caused the event, or None. The frames skipped on the way up depend
    on the event: for frame and object-graph introspection (``sys.*``, ``gc.*``) only ``inspect``'s
    (``inspect.currentframe()`` called by student code is the student's, while ``typing``,
    ``dataclasses`` or ``logging`` reading frames for themselves are not); for ``ctypes`` the
    ``ctypes`` package's; for the rest (file access, processes, setting attributes) the whole
    standard library's, so that ``shutil.copy`` or ``unittest.mock.patch`` called by student
    code count as the student's."""
    skip = _INSPECT if event.startswith(_NARROW) else _CTYPES if event.startswith("ctypes.") else _STDLIB
    f = sys._getframe(2)          # 0: here, 1: _audit, 2: the Python frame the event came from
    while f is not None and (f.f_code.co_filename.startswith(skip) or f.f_code.co_filename.startswith("<frozen")):
        f = f.f_back
    return f if f is not None and _is_student(f.f_code.co_filename) else None


def _owned(obj) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    if isinstance(obj, types.ModuleType):
        mod = obj.__name__
    return mod.split(".")[0] in _OWNED


def _audit(event, args):
    if getattr(_local, "busy", False):
        return
    if event not in _BLOCK and event not in _FLAG and event != "object.__setattr__" and not event.startswith("ctypes."):
        return
    _local.busy = True
    try:
        caller = _student_caller(event)
        if caller is None:
            if event == "open" and args and isinstance(args[0], str) and _outside(args[0]):
                f = sys._getframe(1)
                while f is not None and not _is_student(f.f_code.co_filename):
                    f = f.f_back
                if f is not None:
                    _events.append(("file access outside the working folder", f"{args[0]}"))
            return
        fname = caller.f_code.co_filename
        cell = fname[len(_STUDENT_PREFIX):-1] if fname.startswith(_STUDENT_PREFIX) else os.path.basename(fname)
        where = f"{cell}, line {caller.f_lineno}"
        if event == "object.__setattr__":
            obj, name = args[0], args[1]
            if isinstance(obj, types.FunctionType) and name == "__code__":
                _events.append(("__code__ assignment", where))
                if _owned(obj):
                    raise RuntimeError(f"refused in graded code: assigning {obj.__qualname__}.__code__")
            elif isinstance(obj, type) and _owned(obj):
                _events.append(("setattr on a class of minidist/torch", f"{obj.__qualname__}.{name} at {where}"))
                raise RuntimeError(f"refused in graded code: setting {obj.__qualname__}.{name}")
            return
        if event == "object.__getattr__":
            _events.append(("frame or code introspection", f"{args[1]} at {where}"))
            raise RuntimeError(f"refused in graded code: reading .{args[1]}")
        if event in _BLOCK or event.startswith("ctypes."):
            what = {"gc": "gc", "ctypes": "ctypes", "sys": "sys"}.get(event.split(".")[0], event)
            _events.append((f"{what}: {event}", where))
            raise RuntimeError(f"refused in graded code: {event}")
        if event in _FILE_EVENTS and not (args and isinstance(args[0], (str, bytes, os.PathLike))
                                          and _outside(os.fsdecode(args[0]))):
            return                   # a descriptor, or a path inside the working folder, /tmp, the packages
        _events.append((event, f"{args[0] if args else ''} at {where}"[:200]))
    finally:
        _local.busy = False


_ALLOWED_ROOTS: tuple = ()


def _outside(path) -> bool:
    try:
        p = os.path.abspath(path)
    except Exception:
        return True
    return not p.startswith(_ALLOWED_ROOTS)


# ----------------------------------------------------------------------------- running cells
class _Capture(io.TextIOBase):
    def __init__(self, limit=20000):
        self.parts, self.size, self.limit = [], 0, limit

    def write(self, s):
        s = str(s)
        if self.size < self.limit:
            self.parts.append(s[: self.limit - self.size])
        self.size += len(s)
        return len(s)

    def flush(self):
        pass

    def text(self):
        return "".join(self.parts)


def _transform(source: str) -> str:
    if not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
        return source
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


class _Shell:
    """Enough of ``get_ipython()`` for magics in a solution cell: cell magics run their body."""

    def __init__(self, ns):
        self.ns = ns

    def run_line_magic(self, name, line, *_):
        return None

    def run_cell_magic(self, name, line, cell, *_):
        if name in ("time", "timeit", "capture", "prun"):
            exec(compile(_transform(cell), self.ns.get("__cell_name__", "<cell>"), "exec"), self.ns)

    def system(self, *a, **k):
        return None

    getoutput = system


class CellTimeout(BaseException):
    pass


def _alarm(_sig, _frame):
    raise CellTimeout("cell timed out")


def run_cell(ns, cell, filename, timeout=None):
    """Exec a cell like IPython: the value of a final expression is returned (it may score partial
    credit, as in nbgrader). Returns (value, error, stdout, stderr)."""
    out, err = _Capture(), _Capture()
    value, error = None, None
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    if timeout:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(timeout))
    try:
        tree = ast.parse(_transform(cell["source"]), filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), filename, "eval"), ns)
    except CellTimeout:
        error = ("CellTimeoutError", f"the cell did not finish within {timeout} s")
    except BaseException as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt are errors of the cell too)
        error = (type(e).__name__, str(e)[:2000])
    finally:
        if timeout:
            signal.alarm(0)
        sys.stdout, sys.stderr = saved
    return value, error, out.text(), err.text()


def _number(value):
    if value is None or isinstance(value, bool):
        return None
    try:
        return repr(value)[:200]
    except Exception:
        return "<unprintable>"


def main():
    global _ALLOWED_ROOTS, _STUDENT_FILES
    sys.addaudithook(_audit)
    fd = int(sys.argv[sys.argv.index("--fd") + 1])
    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    os.close(0)
    out = os.fdopen(os.dup(fd), "w", buffering=1)
    os.close(fd)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)           # stray writes to fd 1/2 cannot reach the grader
    os.dup2(os.open(spec.get("log", os.devnull), os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    token = spec["token"]

    def send(**msg):
        out.write(json.dumps(dict(msg, token=token), default=str) + "\n")


    sys.path[:0] = spec.get("path", [])
    workdir = spec.get("workdir") or os.getcwd()
    os.chdir(workdir)
    sys.path.append(workdir)              # helper modules handed in: importable, after minidist and torch
    _STUDENT_FILES = (os.path.realpath(workdir) + "/", workdir.rstrip("/") + "/")
    _ALLOWED_ROOTS = tuple(p.rstrip("/") + "/" for p in [workdir, "/tmp", "/proc/self", "/dev"]) + \
        tuple(p.rstrip("/") + "/" for p in spec.get("path", [])) + (sys.prefix + "/", sys.base_prefix + "/")
    os.environ.update(spec.get("env", {}))
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    ns["get_ipython"] = lambda: _Shell(ns)
    snapshot = None
    protected = {"__builtins__": ns["__builtins__"], "get_ipython": ns["get_ipython"]}
    t_start = time.time()
    for cell in spec["cells"]:
        kind, cid = cell["kind"], cell["id"]
        if kind in ("setup", "given", "test"):
            filename = f"<grader {cid}>"
        else:
            filename = f"{_STUDENT_PREFIX}{cid}>"
        if kind == "test" and snapshot is None:
            snapshot = Snapshot()
        if kind == "solution" and snapshot is None:
            snapshot = Snapshot()                 # the pristine state: before any student code
        if kind == "test":
            rebound = [name for name, value in protected.items() if ns.get(name, EMPTY) is not value]
            for name in rebound:
                ns[name] = protected[name]
            before = snapshot.diff_and_restore() + [f"the notebook's name {n!r}" for n in rebound]
            if before:
                send(event="restored", cell=cid, changes=before[:20])
            t0 = time.time()
            value, error, stdout, stderr = run_cell(ns, cell, filename, spec.get("timeout"))
            after = snapshot.diff_and_restore()
            send(event="test", cell=cid, error=error, stderr=stderr[:2000], value=_number(value),
                 changed=after[:20], seconds=round(time.time() - t0, 2))
        else:
            ns["__cell_name__"] = filename
            had = dict(ns)
            value, error, stdout, stderr = run_cell(ns, cell, filename, spec.get("timeout"))
            send(event="cell", cell=cid, kind=kind, error=error)
            if kind != "solution":     # what the lab's own cells bind from minidist and torch stays bound
                for name, value in ns.items():
                    if had.get(name, EMPTY) is not value and (isinstance(value, types.ModuleType) or _owned(value)):
                        protected[name] = value
        if _events:
            send(event="flags", items=[list(e) for e in _events[:50]])
            _events.clear()
    send(event="done", seconds=round(time.time() - t_start, 2))
    out.flush()
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        os._exit(3)
