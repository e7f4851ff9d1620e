"""The confirmation's child: runs a submission's cells in an interpreter that student code did not
prepare (forked by :mod:`autograder.confirm.parent` inside the sandbox, once it has imported torch and
the pristine minidist and before it reads its spec, :mod:`autograder.confirm.warm`; ``python -I
confirm/runner.py`` runs it alone; it imports nothing from the autograder but its siblings).

What it runs, one cell per request of the parent, in notebook order: the lab's own setup and
given cells (locked cells, from the instructor's source notebook), the student's solution cells
(the only student code that enters), and the test cells with their hidden tests (from the source
notebook). Notebook cells the student added or changed outside the solution cells never run here.

What it guards:

* nothing of the student's runs before the snapshot: files handed in next to the notebook are
  importable only once the setup cells have run and the pristine bindings are recorded, only by
  student code (torch's optional imports never find them), and never under the name of a
  standard or installed module (:mod:`autograder.confirm.handed_in`);
* pristine bindings (:mod:`minidist.checks.kit.bindings`): recorded once the setup cells have
  imported minidist's checks and torch; a change made by the solution cells is put back before the
  tests and reported, a change found after a test fails that test;
* the audit hook (:mod:`autograder.confirm.audit`), installed before anything else;
* the channel: this process holds no token and no descriptor of the grader's. It answers the
  parent's request for one cell on a pipe, echoing that request's nonce: a reply forged while a
  solution cell runs can only speak for that solution cell, since no test has been sent yet. The
  pipe's descriptors are closed in every process forked from this one (the ranks, where graded
  code runs while a test's nonce is in flight), and this process is not dumpable (:func:`_seal`).

Protocol (:mod:`autograder.confirm.wire` frames): first ``{path, workdir, env, timeout, own_pids, keep, hidden}``, then
``{cell: {id, kind, source}, nonce}`` per cell, each answered by ``{cell, nonce, kind, error,
stderr, value, changed, restored, flags, seconds}`` and, for a test, ``docket``: the answers the
judged checks filed while it ran (:mod:`minidist.checks.kit.docket`), for the parent's judge.
"""
import ast
import io
import os
import signal
import sys
import time
import traceback
import types

# the folder holding autograder/confirm/ and minidist/ (the pristine copy; -I leaves it off the path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from autograder.confirm import audit, handed_in, wire  # noqa: E402
from autograder.confirm.hidden_tables import install as install_hidden_tables  # noqa: E402
from minidist import protocol  # noqa: E402

EMPTY = object()



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


def sweep(keep=()) -> list[int]:
    """Kill every process of this run's PID namespace but this one's ancestors (the sandbox's init,
    the parent) and ``keep`` (the parent's judge): a program a solution cell left running (started in
    a new session, even) could otherwise write a rank's result file while a test runs. Only where the
    sandbox made the namespace for this run alone (``own_pids``); elsewhere the machine's processes
    are in view."""
    keep, pid = {int(k) for k in keep}, os.getpid()
    while pid > 0 and pid not in keep:
        keep.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    killed = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in keep:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                pass
    return killed


def _seal(channel):
    """The channel to the parent stays in this process: every process forked from it (the ranks a
    test launches, which run the graded code) closes both descriptors first thing, so a rank that
    reaches this frame (a signal handler's frame walks up to it) holds a nonce but nothing to send
    it on. Not dumpable either: a process of the same uid (a rank) can neither trace this one nor
    open its descriptors or memory through /proc."""
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)     # PR_SET_DUMPABLE

    def close_in_child():
        for fd in channel:
            try:
                os.close(fd)
            except OSError:
                pass
    os.register_at_fork(after_in_child=close_in_child)


def _docket() -> list:
    """The list judged checks file the student's answers in (:mod:`minidist.checks.kit.docket`), if the lab's
    setup imported it: held from before any student code, so rebinding the module's name files nowhere."""
    module = sys.modules.get(protocol.DOCKET_MODULE)
    return module.entries() if module is not None else []


def _filed(docket) -> list:
    """The answers filed during a test, as the wire carries them (entries of another shape are dropped:
    the judge then finds their cases unanswered)."""
    return [list(e) for e in docket[:5000] if protocol.is_docket_entry(e)]


def main():
    send, recv = wire.send, wire.recv          # bound before any student code runs
    cmd, reply = os.dup(0), os.dup(1)
    _seal((cmd, reply))
    sys.addaudithook(audit.audit)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)                           # a stray read or print never touches the channel
    spec = recv(cmd)
    path = list(spec.get("path", []))
    sys.path[:0] = path
    install_hidden_tables(spec.get("hidden"), path[0] if path else "")     # from the grader, no file
    workdir = spec.get("workdir") or os.getcwd()
    os.chdir(workdir)
    # whatever the sandbox lets this process write is student code when it runs
    writable = [workdir, os.path.realpath(workdir), "/tmp", "/dev/shm", os.environ.get("HOME", workdir)]
    audit.STUDENT_FILES[:] = [p.rstrip("/") + "/" for p in writable]
    # The interpreter, its standard library and the environment's packages are read-only in the
    # sandbox wherever they live: a checkout and its .venv under /tmp (as CI's clone may be) is not
    # student code because /tmp is writable around it.
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    audit.TRUSTED_FILES[:] = [p.rstrip("/") + "/" for p in path + [os.path.dirname(os.path.abspath(__file__))]
                              + sorted(installed)]
    audit.ALLOWED_ROOTS[:] = [p.rstrip("/") + "/" for p in [workdir, "/tmp", "/proc/self", "/dev"] + path] + \
        [sys.prefix + "/", sys.base_prefix + "/"]
    os.environ.update(spec.get("env", {}))
    import tempfile
    audit.LAUNCH_ROOT = os.path.realpath(tempfile.gettempdir()).rstrip("/") + "/"
    audit.OWN_FOLDERS = audit.own_folders(audit.LAUNCH_ROOT, workdir)
    notebook = types.ModuleType("__main__")    # `import __main__` is the notebook, not this runner
    sys.modules["__main__"] = notebook
    for name in [m for m in sys.modules if m == "autograder" or m.startswith("autograder.")]:
        sys.modules.pop(name)                  # nor is `from autograder.confirm import audit` the hook's own state
    ns = notebook.__dict__
    ns["__builtins__"] = __builtins__
    ns["get_ipython"] = lambda: _Shell(ns)
    snapshot = None
    protected = {"__builtins__": ns["__builtins__"], "get_ipython": ns["get_ipython"]}
    while True:
        msg = recv(cmd)
        if not isinstance(msg, dict):
            break
        cell, nonce = msg["cell"], msg["nonce"]
        kind, cid = cell["kind"], cell["id"]
        filename = f"{protocol.GRADER_PREFIX if kind in ('setup', 'given', 'test') else protocol.SOLUTION_PREFIX}{cid}>"
        out = {"cell": cid, "kind": kind, "nonce": nonce, "restored": [], "changed": [], "error": None,
               "stderr": "", "value": None}
        if kind in ("test", "solution") and snapshot is None:
            from minidist.checks.kit.bindings import Snapshot      # the pristine minidist's (standard library only)
            snapshot = Snapshot()                 # the pristine state: before any student code
            docket = _docket()                    # the list the judged checks file answers in
            audit.STUDENT_CODE_LOADED = True      # from now on, events are checked for student code
            finder = handed_in.install(workdir, audit._is_student)     # handed-in files: importable from now on
        audit.PROGRAMS_REFUSED = kind == "test"
        if kind == "test":
            if spec.get("own_pids") and sweep(spec.get("keep") or ()):
                audit.events.append(("a process left running by a solution cell (killed)", f"before {cid}"))
            rebound = [name for name, value in protected.items() if ns.get(name, EMPTY) is not value]
            for name in rebound:
                ns[name] = protected[name]
            out["restored"] = (snapshot.diff_and_restore() + [f"the notebook's name {n!r}" for n in rebound])[:20]
            t0 = time.time()
            del docket[:]
            value, error, _stdout, stderr = run_cell(ns, cell, filename, spec.get("timeout"))
            out.update(changed=snapshot.diff_and_restore()[:20], error=error and list(error), stderr=stderr[:2000],
                       value=_number(value), seconds=round(time.time() - t0, 2), docket=_filed(docket))
        else:
            ns["__cell_name__"] = filename
            had = dict(ns)
            value, error, _stdout, _stderr = run_cell(ns, cell, filename, spec.get("timeout"))
            out["error"] = error and list(error)
            if kind != "solution":     # what the lab's own cells bind from minidist and torch stays bound
                for name, value in ns.items():
                    if had.get(name, EMPTY) is not value and (isinstance(value, types.ModuleType) or audit._owned(value)):
                        protected[name] = value
        if snapshot is not None and finder.refused:
            audit.events += [("handed-in module named like a standard or installed one (refused)", n)
                             for n in finder.refused]
            finder.refused.clear()
        out["flags"] = [[str(x) for x in e][:2] for e in audit.events[:50]]
        audit.events.clear()
        send(reply, out)
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        os._exit(3)
