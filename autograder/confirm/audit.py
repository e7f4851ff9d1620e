"""The confirmation child's audit hook (:mod:`autograder.confirm.runner`; standard library and minidist.protocol only).

Installed before anything else runs and impossible to remove from Python, in the process that
executes student code. It refuses, when called from student code, ``ctypes``, the garbage
collector's object graph, frame and code introspection (``sys._getframe`` through ``inspect``,
``traceback`` or ``logging`` too: each hands the caller a frame, and a frame leads to every
local of the runner), ``sys.settrace``/``setprofile``, new audit hooks, assigning ``__code__`` or
attributes of minidist's, torch's and the runner's classes, touching the files of a rank's launch
(a rank that wrote its own result file could claim what a check compares inside the rank), and
starting a program while a test runs (it would run outside this hook; one a solution cell left
running is killed before the tests, :func:`autograder.confirm.runner.sweep`); file access outside the working folder,
sockets and the like are reported. Threads and forked processes stay allowed (a correct answer
may use them; a fork keeps this hook): what they could do with the runner's pipes, the student's
code in the runner can do itself (see :mod:`autograder.confirm.parent` for what that is worth).

Student code is recognised by where its code comes from, not by the file name it claims: the
solution cells (compiled by the runner under ``<solution ID>``), files handed in (the working
folder), every code object exec'd on behalf of student code (by it, by what it calls, such as
``torch.load`` running a pickle's ``exec``, or on a thread other than the main one) or that a
handed-in module defines, whatever file name it was compiled under, and every code student code
assigns to a function's ``__code__``.
"""
import os
import sys
import sysconfig
import threading
import types

from minidist.protocol import LAUNCH_PREFIX, SOLUTION_PREFIX

_local = threading.local()
events: list = []             # (event, detail) reported to the grader as flags
_STUDENT_PREFIX = SOLUTION_PREFIX
_BLOCK = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof", "ctypes.call_function",
          "ctypes.string_at", "ctypes.wstring_at", "ctypes.create_string_buffer", "ctypes.PyObj_FromPtr",
          "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe", "sys.settrace",
          "sys.setprofile", "sys.addaudithook", "sys._current_frames", "function.__new__", "code.__new__",
          "object.__getattr__"}
_FLAG = {"open", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "socket.connect", "os.remove",
         "os.rename", "shutil.rmtree", "os.chmod", "exec", "os.link", "os.symlink", "os.truncate", "os.mkdir",
         "os.rmdir", "os.chown", "os.utime", "os.listxattr", "shutil.copyfile", "shutil.copytree", "shutil.move",
         "os.spawn", "os.fork_exec"}

_NARROW = ("sys.", "gc.", "object.__getattr__", "function.__new__", "code.__new__")
_WATCHED = frozenset(_BLOCK | _FLAG | {"object.__setattr__"})
# Where a rank's launch keeps its result, status and progress files (``tempfile.mkdtemp(prefix=
# LAUNCH_PREFIX)`` in $TMPDIR): code the check launched can reach them, so student code may not; a
# rank that wrote its own result could claim whatever the check compares inside the rank. The
# folder holding this run's own working folder is never one (the grader's area may be named
# ``minidist-sandbox-...`` in the same $TMPDIR: a helper module handed in lives there).
_LAUNCH_FILES = {"open", "os.remove", "os.rename", "shutil.rmtree", "os.chmod", "os.link", "os.symlink",
                 "os.truncate", "os.mkdir", "os.rmdir", "os.chown", "os.utime", "os.listxattr", "shutil.copyfile",
                 "shutil.copytree", "shutil.move"}
# a program run from student code would be outside this hook (it could write the files above)
_PROGRAMS = {"os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork_exec"}
LAUNCH_ROOT = ""                # realpath($TMPDIR) + "/": launches make their LAUNCH_PREFIX folders in it (set by the runner)
OWN_FOLDERS: frozenset = frozenset()   # the folders right in LAUNCH_ROOT that hold the working folder (set by the runner)
PROGRAMS_REFUSED = False        # while a test runs (set by the runner); a solution cell may run one
_FILE_EVENTS = _LAUNCH_FILES    # flagged only outside the working folder, /tmp and the packages
_OWNED = ("minidist", "torch", "autograder")


#: Set by the runner just before the first solution or test cell: until then no code of the student's
#: exists (the lab's setup cells run, handed-in files are not importable yet), and every event passes
#: at once (the imports of torch and minidist raise thousands, each a walk of a deep stack).
STUDENT_CODE_LOADED = False
STUDENT_FILES: list = []        # the working folder: files handed in next to the notebook are student code
_STUDENT_CODE: dict = {}        # id -> code object student code exec'd, whatever its file name (a code
                                # object's hash walks all of its constants: too slow for every event)


TRUSTED_FILES: list = []        # read-only inside the sandbox though below a writable place (the pristine minidist)


def _is_student(code) -> bool:
    filename = code.co_filename
    return (filename.startswith(_STUDENT_PREFIX) or _STUDENT_CODE.get(id(code)) is code
            or (bool(STUDENT_FILES) and filename.startswith(tuple(STUDENT_FILES))
                and not filename.startswith(tuple(TRUSTED_FILES))))


def _mark_student(code) -> None:
    if isinstance(code, types.CodeType) and _STUDENT_CODE.get(id(code)) is not code:
        _STUDENT_CODE[id(code)] = code
        for const in code.co_consts:
            _mark_student(const)

_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + "/" for k in ("stdlib", "platstdlib")} |
                {sysconfig.get_paths()[k] + "/" for k in ("stdlib", "platstdlib")})


# torch's own frames are never skipped on the way up: torch doing its bookkeeping (a dataclass's
# __doc__ set while a solution cell imports torch.distributed._functional_collectives) is not the
# student's doing. Installed helpers (pytest's monkeypatch, say) are skipped like the standard
# library: a virtual environment's platstdlib (.venv/lib/python3.X) is a prefix of its site-packages.
_TORCH = tuple(sorted({os.path.realpath(sysconfig.get_paths()[k]) + "/torch/" for k in ("purelib", "platlib")} |
                      {sysconfig.get_paths()[k] + "/torch/" for k in ("purelib", "platlib")}))


def _skipped(filename: str, skip: tuple) -> bool:
    return filename.startswith("<frozen") or (filename.startswith(skip) and not filename.startswith(_TORCH))


_INSPECT = tuple(p + name for p in _STDLIB for name in ("inspect.py", "traceback.py", "logging/", "bdb.py", "pdb.py",
                                                         "cgitb.py", "trace.py", "asyncio/"))
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
    while f is not None and not _is_student(f.f_code) and _skipped(f.f_code.co_filename, skip):
        f = f.f_back
    return f if f is not None and _is_student(f.f_code) else None


_IMPORTLIB = "<frozen importlib._bootstrap"


def _on_behalf_of_student(caller) -> bool:
    """Whether code about to be exec'd runs for student code: exec'd by it, or by anything it
    called (``torch.load`` unpickling what a solution cell wrote names ``exec`` from torch's frame),
    or on a thread other than the main one (a thread student code started with ``eval`` as its
    target has no student frame). The import system executing a module is not, whoever imports."""
    if _is_student(caller.f_code):
        return True
    if caller.f_code.co_filename.startswith(_IMPORTLIB):
        return False
    if threading.current_thread() is not threading.main_thread():
        return True
    f = caller
    while f is not None:
        if _is_student(f.f_code):
            return True
        f = f.f_back
    return False


def _owned(obj) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    if isinstance(obj, types.ModuleType):
        mod = obj.__name__
    return mod.split(".")[0] in _OWNED


def audit(event, args):
    # Called for every audited event of the process (ranks included): the common ones leave at once.
    if not STUDENT_CODE_LOADED or (event not in _WATCHED and not event.startswith("ctypes.")):
        return
    if event == "object.__getattr__" and args[1] == "f_code":
        # Only a frame has an f_code, and every way to a frame (sys._getframe, tb_frame, gi_frame,
        # cr_frame, ag_frame, gc, settrace) is refused above; the refusal's tracer reads it at every
        # call (millions of events a lab, each a walk of the stack here: +50 % on lab 3's confirmation).
        return
    if getattr(_local, "busy", False):
        return
    _local.busy = True
    try:
        if event == "exec":              # exec/eval on behalf of student code: the student's code, under
            if _on_behalf_of_student(sys._getframe(1)):   # whatever file name it was compiled
                _mark_student(args[0])
            return
        caller = _student_caller(event)
        if caller is None:
            if event == "open" and args and isinstance(args[0], str) and _outside(args[0]):
                f = sys._getframe(1)
                while f is not None and not _is_student(f.f_code):
                    f = f.f_back
                if f is not None:
                    events.append(("file access outside the working folder", f"{args[0]}"))
            return
        fname = caller.f_code.co_filename
        cell = fname[len(_STUDENT_PREFIX):-1] if fname.startswith(_STUDENT_PREFIX) else os.path.basename(fname)
        where = f"{cell}, line {caller.f_lineno}"
        if event == "object.__setattr__":
            obj, name = args[0], args[1]
            if isinstance(obj, types.FunctionType) and name in ("__code__", "__defaults__", "__kwdefaults__"):
                events.append((f"{name} assignment", where))
                if name == "__code__" and len(args) > 2:
                    _mark_student(args[2])
                if _owned(obj):      # the checks' watch of their bindings leaves these to this hook
                    raise RuntimeError(f"refused in graded code: assigning {obj.__qualname__}.{name}")
            elif isinstance(obj, (type, types.ModuleType)) and _owned(obj):
                events.append(("setattr on a class of minidist/torch", f"{obj.__qualname__}.{name} at {where}"))
                raise RuntimeError(f"refused in graded code: setting {obj.__qualname__}.{name}")
            return
        if event == "object.__getattr__":
            events.append(("frame or code introspection", f"{args[1]} at {where}"))
            raise RuntimeError(f"refused in graded code: reading .{args[1]}")
        if event in _PROGRAMS and PROGRAMS_REFUSED:
            events.append(("a program started from graded code (refused)", f"{args[0] if args else ''} at {where}"[:200]))
            raise RuntimeError(f"refused in graded code: {event} (no program may run during grading)")
        if event in _LAUNCH_FILES and LAUNCH_ROOT and any(_in_launch_dir(a) for a in args[:2]):
            events.append(("a launch's own files touched (refused)", f"{event} at {where}"))
            raise RuntimeError(f"refused in graded code: {event} on the files of a rank's launch")
        if event in _BLOCK or event.startswith("ctypes."):
            what = {"gc": "gc", "ctypes": "ctypes", "sys": "sys"}.get(event.split(".")[0], event)
            events.append((f"{what}: {event}", where))
            raise RuntimeError(f"refused in graded code: {event}")
        if event in _FILE_EVENTS and not (args and isinstance(args[0], (str, bytes, os.PathLike))
                                          and _outside(os.fsdecode(args[0]))):
            return                   # a descriptor, or a path inside the working folder, /tmp, the packages
        events.append((event, f"{args[0] if args else ''} at {where}"[:200]))
    finally:
        _local.busy = False


ALLOWED_ROOTS: list = []


def _in_launch_dir(arg) -> bool:
    """Whether ``arg`` lies in a launch's folder: a folder right in $TMPDIR named ``minidist-...`` that
    does not hold this run's working folder."""
    if not isinstance(arg, (str, bytes, os.PathLike)):
        return False
    try:
        p = os.path.realpath(os.fsdecode(arg))
    except Exception:
        return True
    if not p.startswith(LAUNCH_ROOT):
        return False
    top = p[len(LAUNCH_ROOT):].split("/", 1)[0]
    return top.startswith(LAUNCH_PREFIX) and top not in OWN_FOLDERS


def own_folders(root: str, workdir: str) -> frozenset:
    """The folder right in ``root`` (the launches' $TMPDIR, ending in "/") that holds ``workdir``, if any."""
    work = os.path.realpath(workdir) + "/"
    return frozenset([work[len(root):].split("/", 1)[0]]) if work.startswith(root) else frozenset()


def _outside(path) -> bool:
    try:
        p = os.path.abspath(path)
    except Exception:
        return True
    return not p.startswith(tuple(ALLOWED_ROOTS))

