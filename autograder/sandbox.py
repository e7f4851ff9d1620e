"""A sandbox per kernel: Linux namespaces through bubblewrap (where installed) or ``unshare``.

Everything student code runs in (the Jupyter kernel nbgrader drives, and the confirmation run,
:mod:`autograder.confirm`) is started through :func:`command`. Inside, the process sees:

* read-only: the interpreter and its installed packages, the system's libraries, and the
  *pristine* minidist (a copy made when the batch starts, see :func:`pristine_minidist`);
* read-write: its private working folder (and, for a kernel, its connection folder), a private
  ``/tmp``. A kernel's working folder is a copy of the *submitted* folder, mounted at the path
  nbgrader gives it: nbgrader's own folder holds the notebook being graded with the hidden
  tests already written back in, which a student cell could otherwise simply open;
* nothing else: not ``solutions/``, not ``autograder/``, not the repository, no other job, no
  grader records, no network (a new network namespace with only loopback), no other process
  (a new PID namespace: when the sandbox's first process exits, everything in it dies).

:func:`probe` runs once per batch and says which backend works here; where none does, the
grader says so once per batch and in every row of ``results.csv``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

INIT = Path(__file__).resolve().with_name("sandbox_init.py")
ROOT_MOUNTPOINT = "/tmp/minidist-sandbox-root"      # each sandbox mounts its own tmpfs here, privately
SYSTEM_RO = ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/etc", "/sys"]
NOT_SANDBOXED = "no sandbox: kernels ran with the grading user's full access (see autograder/README.md)"


@dataclass(frozen=True)
class Backend:
    name: str                 # "bwrap" or "unshare"
    exe: str

    def __str__(self):
        return f"{self.name} ({self.exe})"


def _python_ro() -> list[str]:
    """The interpreter's prefixes and package folders (read-only inside)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(p)
            paths.add(os.path.realpath(p))
    out = []
    for p in sorted(paths, key=len):          # drop paths inside another one already listed
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def ro_paths(extra: list[str] = ()) -> list[str]:
    return [p for p in SYSTEM_RO if os.path.lexists(p)] + _python_ro() + list(extra)


def _bwrap_argv(exe, argv, ro, rw, cwd, env):
    cmd = [exe, "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--tmpfs", "/", "--tmpfs", "/tmp"]
    for p in ro:
        cmd += ["--symlink", os.readlink(p), p] if os.path.islink(p) else ["--ro-bind", p, p]
    for src, dest in rw:
        cmd += ["--bind", src, dest]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/",
            "--chdir", cwd or "/tmp", "--clearenv"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    return cmd + ["--"] + list(argv)


def command(backend: Backend | None, argv: list[str], *, rw: list[str], cwd: str | None, env: dict,
            ro_extra: list[str] = (), spec_dir: str | None = None) -> list[str]:
    """The argv that runs ``argv`` in a sandbox (``backend`` None: unchanged, unsandboxed).

    ``rw`` holds paths, each seen at its own place, or ``(source, seen_at)`` pairs."""
    if backend is None:
        return list(argv)
    ro = ro_paths(ro_extra)
    rw = [(str(p[0]), str(p[1])) if isinstance(p, (tuple, list)) else (str(p), str(p)) for p in rw]
    if backend.name == "bwrap":
        return _bwrap_argv(backend.exe, argv, ro, rw, cwd, env)
    spec = {"root": ROOT_MOUNTPOINT, "ro": ro, "rw": rw, "cwd": cwd, "argv": list(argv), "env": env,
            "tmp_size": "2g"}
    spec_dir = spec_dir or tempfile.gettempdir()
    path = os.path.join(spec_dir, f"sandbox-{uuid.uuid4().hex[:12]}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return [backend.exe, "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
            "--fork", "--kill-child", sys.executable, "-I", "-S", str(INIT), path]


_PROBE = r"""
import os, socket, sys
bad = [p for p in sys.argv[1:] if os.path.exists(p)]
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
c = socket.create_connection(s.getsockname()); c.close()
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1); bad.append("network")
except OSError:
    pass
print("ok" if not bad and os.getpid() <= 3 else "leaks: %s pid %d" % (bad, os.getpid()))
"""


def probe(hidden: list[str] = ()) -> tuple[Backend | None, str]:
    """The first backend that isolates here: (backend, what it is) or (None, why not).

    A candidate must start a process that sees none of ``hidden`` (e.g. the repository), can use
    loopback, has no other network, and is an early PID of its own namespace."""
    if os.environ.get("MINIDIST_SANDBOX", "").lower() in ("0", "off", "none", "no"):
        return None, "sandbox turned off (MINIDIST_SANDBOX=off)"
    if not sys.platform.startswith("linux"):
        return None, f"no Linux namespaces on {sys.platform}"
    reasons = []
    for name in ("bwrap", "unshare"):
        exe = shutil.which(name)
        if not exe:
            reasons.append(f"{name}: not installed")
            continue
        backend = Backend(name, exe)
        hidden = [str(h) for h in hidden]
        argv = command(backend, [sys.executable, "-I", "-S", "-c", _PROBE, *hidden], rw=[], cwd="/tmp",
                       env={"PATH": "/usr/bin:/bin"})
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as err:
            reasons.append(f"{name}: {err}")
            continue
        if r.returncode == 0 and r.stdout.strip() == "ok":
            return backend, str(backend)
        reasons.append(f"{name}: " + (r.stdout.strip() or r.stderr.strip().splitlines()[-1:] or ["failed"])[0][:160])
    return None, "no sandbox possible here (" + "; ".join(reasons) + ")"


# ----------------------------------------------------------------------------- environment
#: variables a sandboxed process may inherit (the grader's own environment may hold secrets)
PASS_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "NBGRADER_EXECUTION", "PYTHONHASHSEED", "JPY_SESSION_NAME")


def inner_env(env, home: str, pristine: str, tag_var: str) -> dict:
    """The environment inside a sandbox: a private home, the pristine minidist first on the
    path, matplotlib's cache pre-filled, the job's kill tag, and nothing else of the grader's."""
    out = {k: v for k, v in env.items() if k in PASS_ENV or k.startswith("MINIDIST_") or k == tag_var}
    out.pop("MINIDIST_SOLUTIONS", None)
    out.pop("MINIDIST_BUGBANK", None)
    out.pop("MINIDIST_LABS", None)
    out.update(HOME=home, IPYTHONDIR=os.path.join(home, ".ipython"), MPLCONFIGDIR=os.path.join(home, ".mpl"),
               MPLBACKEND="Agg", JUPYTER_RUNTIME_DIR=os.path.join(home, ".runtime"), TMPDIR="/tmp",
               PYTHONPATH=pristine, PYTHONDONTWRITEBYTECODE="1")
    out.setdefault("PATH", "/usr/bin:/bin")
    return out


def outer_env(env: dict, tag_var: str) -> dict:
    """The environment of the sandbox launcher itself (what runs inside gets its own)."""
    return {k: v for k, v in env.items() if k in ("PATH", "LANG", "LC_ALL", tag_var)}


def prepare_home(home: Path, skeleton: Path | None) -> Path:
    """A private home for one sandboxed process tree: matplotlib's font cache copied in."""
    home.mkdir(parents=True, exist_ok=True)
    if skeleton is not None and skeleton.is_dir():
        shutil.copytree(skeleton, home, dirs_exist_ok=True)
    for sub in (".ipython", ".mpl", ".runtime"):
        (home / sub).mkdir(exist_ok=True)
    return home


def build_skeleton(dest: Path) -> Path:
    """Once per batch: a home whose matplotlib font cache is already built (0.3 s per kernel saved)."""
    (dest / ".mpl").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MPLCONFIGDIR=str(dest / ".mpl"), MPLBACKEND="Agg")
    try:
        subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], env=env, timeout=120,
                       capture_output=True)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return dest


# ----------------------------------------------------------------------------- the kernel
try:
    from jupyter_client.manager import AsyncKernelManager as KernelManager
except ImportError:          # pragma: no cover  (jupyter is a dev dependency)
    KernelManager = object


class SandboxKernelManager(KernelManager):
    """nbclient's kernel manager, with the kernel started inside the sandbox.

    The worker sets :attr:`settings` (backend, home, pristine, tag_var, workdir) before nbgrader
    runs. The kernel talks to nbclient over Unix sockets in its private home (``transport="ipc"``),
    because it has no network; its working folder (``workdir``, a copy of the submission, seen at
    the notebook's path) and its home are the only writable places it sees."""

    settings: dict = {}

    def __init__(self, **kw):
        super().__init__(**kw)
        s = type(self).settings
        if s.get("backend") is not None:
            self.transport = "ipc"
            self.ip = os.path.join(s["home"], "k")
            self.connection_file = os.path.join(s["home"], "kernel.json")

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        s = type(self).settings
        if s.get("backend") is None:
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        cwd = str(kw.get("cwd") or os.getcwd())
        env = inner_env(kw.get("env") or os.environ, s["home"], s["pristine"], s["tag_var"])
        argv = command(s["backend"], kernel_cmd, rw=[(s["workdir"], cwd), s["home"]], cwd=cwd, env=env,
                       ro_extra=[s["pristine"]], spec_dir=s["home"])
        kw["env"] = outer_env(dict(kw.get("env") or os.environ), s["tag_var"])
        return await super()._async_launch_kernel(argv, **kw)
