"""The confirmation's warm start: its parent imports torch and the pristine minidist once, then forks
the judge and the child from itself (:mod:`autograder.confirm.parent`; standard library and the
pristine copy only).

Every confirmation used to start its judge and its child as fresh interpreters, each importing torch
(about 95 % of either's CPU time on a small lab). The parent, which never runs student code, now
imports what both need (:func:`preload`: torch, ``torch.distributed``, minidist and the lab's checks
modules, from the pristine copy) *before it reads anything of the run*: its spec (the token, the
cells, the hidden tables) comes on stdin only after both forks exist (:func:`fork`). A fork therefore
holds in memory what a fresh interpreter that imported the same modules holds, and nothing of the
grader's. Each fork:

* keeps only its own two pipes (as its stdin and stdout), stderr (the run's log) and the descriptors
  the imports opened; every other descriptor, the grader's among them, is closed;
* draws fresh seeds for Python's, torch's and numpy's generators (a fresh interpreter's are random);
* is not dumpable (inherited from the parent, set before the imports), so no process of the job's uid
  can trace it or read its memory before it has run a line of its own;
* runs once and exits: nothing a fork did returns to the parent, which forks no process after the
  child has started.

The imports run with ``/`` as the working folder (a handed-in file next to the notebook is never read
by them) and with the run's environment (``MINIDIST_DOCKET``, ``MINIDIST_GUARD_BINDINGS``: the checks
read them once, at import), which the grader gives the whole sandbox (:mod:`autograder.confirm.start`).
"""
import ast
import os
import random
import sys
import traceback

#: the packages whose modules a lab's own cells name that the parent imports for its forks: the pristine
#: minidist (its checks included) and torch
PACKAGES = ("minidist", "torch")
#: what every confirmation imports, besides the modules its lab's cells name
COMMON = ("torch", "torch.distributed", "minidist", "autograder.confirm.runner", "autograder.confirm.judge")


def modules(sources) -> list:
    """The modules of :data:`PACKAGES` the lab's own cells (the instructor's setup and given cells) import,
    as ``import X`` or ``from X import Y`` names them (Y too, where it may be a module)."""
    out = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    return sorted(m for m in out if _ours(m))


def _ours(name) -> bool:
    return (isinstance(name, str) and name.split(".")[0] in PACKAGES
            and all(part.isidentifier() for part in name.split(".")))


def preload(names) -> set:
    """Import :data:`COMMON` and ``names`` (modules of :data:`PACKAGES`; anything else is ignored, and
    a ``from X import Y`` name that is no module is skipped) with ``/`` as the working folder; the
    descriptors the imports left open (kept in every fork). A module that fails to import is left to the
    fork, which imports it again and meets the same error where a fresh interpreter would."""
    before = _open_fds()
    here = os.getcwd()
    os.chdir("/")
    try:
        for name in list(COMMON) + sorted({m for m in names if _ours(m)}):
            try:
                __import__(name)
            except Exception:      # noqa: BLE001  (not a module, or the fork meets the error again)
                pass
    finally:
        os.chdir(here)
    return _open_fds() - before


def fork(target, keep: set) -> tuple[int, int, int]:
    """Fork a process that runs ``target()`` with a new pipe from this process as its stdin and a new
    pipe to it as its stdout, the descriptors ``keep`` and stderr, and nothing else; it exits when
    ``target`` returns or raises. Returns (pid, the descriptor to write its stdin, the one to read its
    stdout)."""
    cmd_r, cmd_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(cmd_r, 0)
            os.dup2(reply_w, 1)
            for fd in _open_fds() - {0, 1, 2} - set(keep):
                try:
                    os.close(fd)
                except OSError:
                    pass
            reseed()
            target()
        except BaseException:      # noqa: BLE001  (the log gets it; the parent sees the pipe close)
            traceback.print_exc()
        os._exit(3)
    os.close(cmd_r)
    os.close(reply_w)
    return pid, cmd_w, reply_r


def reseed() -> None:
    """Fresh seeds for the generators a fresh interpreter would have seeded at random."""
    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _open_fds() -> set:
    out = set()
    for fd in map(int, os.listdir("/proc/self/fd")):      # the listing's own descriptor is closed by now
        try:
            os.fstat(fd)
            out.add(fd)
        except OSError:
            pass
    return out
