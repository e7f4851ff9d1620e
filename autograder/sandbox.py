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
  (a new PID namespace: when the sandbox's first process exits, everything in it dies);
* no privilege: :mod:`autograder.sandbox_drop` sets the job's limits and, when the grader runs
  as root, switches to the job's own unprivileged uid *before* the user namespace exists, so the
  sandbox's users map to that uid and never to the machine's root; inside, the submission is uid
  1000 with no capability and ``no_new_privs``; ``/sys`` and ``/proc/sys`` are read-only all the
  way down and ``/dev`` is a fresh minimal one (see :data:`GUARANTEES`).

Whatever a sandboxed process must read or write has to be reachable by that uid: the grader keeps
it in a per-batch *area* (:func:`make_area`, traversable by anyone, each job's folder its own uid's).

:func:`probe` runs once per batch and says which backend works here; where none does, the
grader says so once per batch and in every row of ``results.csv``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
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
DROP = Path(__file__).resolve().with_name("sandbox_drop.py")
INNER_ID = 1000                                     # the submission's uid/gid inside (sandbox_init.INNER_ID)
UID_BASE, UID_SPAN = 1_900_000_000, 100_000_000     # a root grader's jobs run as uids from this range
GUARANTEES = ("{uid} (never root), no capabilities, no_new_privs; /sys and "
              "/proc/sys read-only; a minimal /dev; per process: {nproc} tasks of the uid, "
              "{mem} GiB address space, {cpu} CPU s, nice +{nice}")


def limits(cpu_seconds: float = 1200) -> dict:
    """The limits of one job's sandboxed processes (``MINIDIST_SANDBOX_MEMORY_GB`` overrides the
    address space): tasks of the job's uid (threads count; torch starts many), address space, CPU
    time and file size per process, and a nice level so that a submission cannot starve the grader."""
    mem = float(os.environ.get("MINIDIST_SANDBOX_MEMORY_GB") or 8)
    return {"nproc": 4096, "address_space": int(mem * (1 << 30)), "cpu_seconds": int(cpu_seconds),
            "file_size": 4 << 30, "nice": 5}


def job_uid(tag: str) -> int | None:
    """The unprivileged uid a root grader gives one job (None: the grader is no root, keeps its own)."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + int(tag, 16) % UID_SPAN


def describe(backend: "Backend", uid: int | None = None) -> str:
    """What the sandbox guarantees here, in one line (the doctor's, and ``results.csv``'s)."""
    lim = limits()
    who = ("the job's own unprivileged uid" if os.geteuid() == 0 else
           f"the grader's uid {os.getuid()} outside, {INNER_ID} inside")
    return f"{backend}: " + GUARANTEES.format(uid=who if uid is None else uid, nproc=lim["nproc"],
                                              mem=f"{lim['address_space'] / (1 << 30):g}",
                                              cpu=lim["cpu_seconds"], nice=lim["nice"])


def make_area(parent: str | None = None) -> Path:
    """The batch's folder for everything a sandbox sees of the grader's files: traversable (not
    listable) by the jobs' uids, whatever the folders above ``out`` allow."""
    area = Path(tempfile.mkdtemp(prefix="minidist-sandbox-", dir=parent))
    os.chmod(area, 0o711)
    return area


def give(path, uid: int | None) -> None:
    """Hand ``path`` (and everything in it) to a job's uid, so its sandbox may write there."""
    if uid is None or os.geteuid() != 0:
        return
    os.chown(path, uid, uid, follow_symlinks=False)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)


def gpus_asked() -> bool:
    """Whether this job's sandboxes get the GPU devices (``MINIDIST_SANDBOX_GPU=1``, set by
    ``grade --gpus-per-job``)."""
    return os.environ.get("MINIDIST_SANDBOX_GPU", "").lower() in ("1", "yes", "on")


def gpu_devices() -> list[str]:
    """The GPU device nodes a sandbox gets when asked, the same for both backends: every
    ``/dev/nvidia*`` node (``nvidiactl``, ``nvidia-uvm``, ``nvidia0``...) and folder
    (``nvidia-caps``), ``/dev/dri`` and ``/dev/kfd`` where present. Which GPUs a job *uses* is
    its ``CUDA_VISIBLE_DEVICES`` (:func:`autograder.grade.gpu_slots`)."""
    if not gpus_asked():
        return []
    import glob
    return sorted(glob.glob("/dev/nvidia*") + [d for d in ("/dev/dri", "/dev/kfd") if os.path.exists(d)])


#: what every sandbox's /dev holds besides the GPU devices, whichever backend built it (bwrap's --dev)
DEV_ENTRIES = frozenset({"null", "zero", "full", "random", "urandom", "tty", "shm", "fd", "stdin", "stdout",
                         "stderr", "pts", "ptmx", "core"})


def shm_bytes() -> int:
    """The size of a sandbox's private ``/dev/shm`` (``MINIDIST_SANDBOX_SHM_GB`` overrides): 4 GiB.

    NCCL's shared-memory transport (used between GPUs of one node that cannot reach each other
    directly) puts each connection's buffers in ``/dev/shm``: per channel about 9.2 MiB (the
    SIMPLE protocol's 4 MiB ``NCCL_BUFFSIZE``, LL128's 4.7 MiB, LL's 0.5 MiB). At 8 ranks a rank
    holds, for collectives, up to 4 channels x 4 peers (ring neighbours, tree parent and
    children), about 147 MiB, and for point-to-point up to 7 peers x 2 channels x 4 MiB, 56 MiB:
    about 200 MiB a rank, 1.6 GiB for 8; 4 GiB leaves room for torch's own shared tensors. A
    tmpfs's size is a cap, not a reservation: honest work uses what it writes; a submission can
    pin at most this much memory there (docker's 64 MiB default makes NCCL fail in ``ncclShmOpen``)."""
    return int(float(os.environ.get("MINIDIST_SANDBOX_SHM_GB") or 4) * (1 << 30))


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


def _parents(paths) -> list[str]:
    """Every folder above ``paths`` (bwrap would copy the machine's modes, e.g. a 0700 /root
    above the interpreter, which the job's uid could not traverse)."""
    out = []
    for p in paths:
        parts = Path(p).parts
        for k in range(2, len(parts)):
            d = str(Path(*parts[:k]))
            if d not in out and d != "/tmp":
                out.append(d)
    return out


def _bwrap_argv(exe, argv, ro, rw, cwd, env, devices, root: bool):
    # --ro-bind is recursive and read-only all the way down; --proc makes /proc/sys read-only,
    # --dev builds a fresh minimal /dev. A root grader's bwrap makes no user namespace (it would
    # map the sandbox to root): the drop step inside switches to the job's uid instead
    ns = (["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"] if root else
          ["--unshare-all", "--unshare-user", "--uid", str(INNER_ID), "--gid", str(INNER_ID), "--cap-drop", "ALL"])
    # /tmp writable by the job's uid, as with unshare (a root-owned 0755 tmpfs otherwise: tempfile would
    # fall back to the working folder, and the two backends would keep a launch's files in different places)
    cmd = [exe, *ns, "--die-with-parent", "--tmpfs", "/", "--perms", "01777", "--tmpfs", "/tmp"]
    links = [p for p in ro if os.path.islink(p)]
    for d in _parents([p for p in ro if p not in links] + [dest for _, dest in rw]):
        cmd += ["--perms", "0755", "--dir", d]
    for p in ro:
        cmd += ["--symlink", os.readlink(p), p] if p in links else ["--ro-bind", p, p]
    for src, dest in rw:
        cmd += ["--bind", src, dest]
    cmd += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]     # /proc/sys: read-only here too
    for d in devices:
        cmd += ["--dev-bind", d, d]
    # /dev read-only (in a user namespace its tmpfs is the submission's own), /dev/shm writable
    cmd += ["--remount-ro", "/dev", "--size", str(shm_bytes()), "--tmpfs", "/dev/shm", "--remount-ro", "/",
            "--chdir", cwd or "/tmp", "--clearenv"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    return cmd + ["--"] + list(argv)


def command(backend: Backend | None, argv: list[str], *, rw: list[str], cwd: str | None, env: dict,
            ro_extra: list[str] = (), uid: int | None = None, limit: dict | None = None,
            tools: str | None = None) -> list[str]:
    """The argv that runs ``argv`` in a sandbox (``backend`` None: unchanged, unsandboxed), with
    the drop step (``uid``: the job's, see :func:`job_uid`; ``limit``: :func:`limits`; ``tools``: the
    folder holding copies of ``sandbox_init.py`` and ``sandbox_drop.py`` that uid can read,
    :func:`install_tools`).

    A grader running as root builds the sandbox as root (it can reach the interpreter wherever
    it lives) and drops to ``uid`` inside, before ``argv``; an ordinary grader drops first (limits
    only) and lets the backend's user namespace build it. ``rw`` holds paths, each seen at its own
    place, or ``(source, seen_at)`` pairs."""
    if backend is None:
        return list(argv)
    tools = str(tools or Path(__file__).resolve().parent)
    root = os.geteuid() == 0
    ro = ro_paths(list(ro_extra) + ([tools] if root else []))
    rw = [(str(p[0]), str(p[1])) if isinstance(p, (tuple, list)) else (str(p), str(p)) for p in rw]
    devices = gpu_devices()
    cfg = dict(limit or limits(), uid=uid, gid=uid)
    if devices:
        cfg["address_space"] = None        # CUDA reserves address space far beyond any memory cap
    drop = [sys.executable, "-I", "-S", os.path.join(tools, DROP.name), json.dumps(cfg), "--"]
    inside = drop + list(argv) if root else list(argv)
    if backend.name == "bwrap":
        inner = _bwrap_argv(backend.exe, inside, ro, rw, cwd, env, devices, root)
    else:
        spec = {"root": ROOT_MOUNTPOINT, "ro": ro, "rw": rw, "cwd": cwd, "argv": inside, "env": env,
                "tmp_size": "2g", "shm_size": shm_bytes(), "devices": devices, "userns": not root}
        inner = [backend.exe, *([] if root else ["--user", "--map-root-user"]), "--mount", "--pid", "--net",
                 "--ipc", "--uts", "--fork", "--kill-child", sys.executable, "-I", "-S",
                 os.path.join(tools, INIT.name), json.dumps(spec)]
    return inner if root else drop + inner


_PROBE = r"""
import os, socket, sys
DEV = set(sys.argv[1].split(","))
bad = [p for p in sys.argv[2:] if os.path.exists(p)]
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
c = socket.create_connection(s.getsockname()); c.close()
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1); bad.append("network")
except OSError:
    pass
if os.getuid() == 0 or os.geteuid() == 0:
    bad.append("uid 0")
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapEff", "CapPrm", "CapBnd"))]
if any(int(c, 16) for c in caps):
    bad.append("capabilities")
for path in ("/proc/sys/kernel/core_pattern", "/sys/fs/cgroup/minidist-probe", "/dev/minidist-probe"):
    try:
        open(path, "a").close(); bad.append("writable: " + path)
    except OSError:
        pass
extra = sorted(e for e in set(os.listdir("/dev")) - DEV if not e.startswith(("nvidia", "dri", "kfd")))
if extra:
    bad.append("/dev has " + " ".join(extra[:5]))
print("ok" if not bad and os.getpid() <= 3 else "leaks: %s pid %d" % (bad, os.getpid()))
"""


def install_tools(area: Path) -> str:
    """Copies of ``sandbox_init.py`` and ``sandbox_drop.py`` the jobs' uids can read (the
    repository may be private), in ``area/bin``."""
    dest = Path(area) / "bin"
    dest.mkdir(exist_ok=True)
    os.chmod(dest, 0o755)                   # whatever the grader's umask
    for f in (INIT, DROP):
        shutil.copyfile(f, dest / f.name)
        os.chmod(dest / f.name, 0o644)
    return str(dest)


class JobsCannotReach(Exception):
    """The sandbox works here, but a job's uid cannot reach what it needs (:mod:`autograder.sandbox_reach`):
    grading would only lose every submission's points, so the grader stops before the first job."""


def probe(hidden: list[str] = (), area: Path | None = None, pristine: str | None = None,
          programs: list[str] = ()) -> tuple[Backend | None, str]:
    """The first backend that isolates here: (backend, what it guarantees) or (None, why not).

    A candidate must start a process that sees none of ``hidden`` (e.g. the repository), can use
    loopback, has no other network, is an early PID of its own namespace, and has no privilege:
    not uid 0, no capability, ``/proc/sys``, ``/sys`` and ``/dev`` not writable, a minimal ``/dev``.
    First, as a job's uid inside it, a shell checks that the interpreter, its packages, ``programs``
    (the kernel's interpreter) and the ``pristine`` minidist (bound read-only, as for a job) are
    within reach; a backend that works but leaves them out of reach raises
    :class:`JobsCannotReach` with the message for the instructor (falling back to no sandbox would
    run every kernel with the grader's privileges)."""
    from autograder import sandbox_reach
    if os.environ.get("MINIDIST_SANDBOX", "").lower() in ("0", "off", "none", "no"):
        return None, "sandbox turned off (MINIDIST_SANDBOX=off)"
    if not sys.platform.startswith("linux"):
        return None, f"no Linux namespaces on {sys.platform}"
    reasons = []
    own_area = area is None
    area = Path(area) if area is not None else make_area()
    try:
        tools = install_tools(area)
        uid = job_uid(uuid.uuid4().hex)
        bound = [str(pristine)] if pristine else []
        inside = [os.path.join(tools, f.name) for f in (DROP, INIT)] if os.geteuid() == 0 else []   # see command()
        wanted = sandbox_reach.needs([os.path.join(p, "minidist", "__init__.py") for p in bound] + inside, programs)
        for name in _backends():
            exe = shutil.which(name)
            if not exe:
                reasons.append(f"{name}: not installed")
                continue
            backend = Backend(name, exe)
            walked = _run_inside(backend, ["/bin/sh", "-c", sandbox_reach.WALK, "sh", *wanted], uid, tools, bound)
            found = sandbox_reach.blocked(walked.stdout) if isinstance(walked, subprocess.CompletedProcess) else None
            if found is None:                      # the backend itself does not work here
                reasons.append(f"{name}: {_why(walked)}")
                continue
            if found:
                raise JobsCannotReach(sandbox_reach.explain(found, uid))
            r = _run_inside(backend, [sys.executable, "-I", "-S", "-c", _PROBE, ",".join(sorted(DEV_ENTRIES)),
                                      *map(str, hidden)], uid, tools, bound)
            if isinstance(r, subprocess.CompletedProcess) and r.returncode == 0 and r.stdout.strip() == "ok":
                return backend, describe(backend)
            reasons.append(f"{name}: {_why(r)}")
    finally:
        if own_area:
            shutil.rmtree(area, ignore_errors=True)
    return None, "no sandbox possible here (" + "; ".join(reasons) + ")"


def _why(r) -> str:
    """Why a sandboxed probe did not say ok, in a line."""
    if not isinstance(r, subprocess.CompletedProcess):
        return str(r)[:160]
    return ([r.stdout.strip()] if r.stdout.strip() else r.stderr.strip().splitlines()[-1:] or ["failed"])[0][:160]


def _run_inside(backend: Backend, argv: list[str], uid, tools, ro_extra=()):
    """``argv`` run in a sandbox of ``backend`` as a job's uid: the finished process, or the error."""
    try:
        return subprocess.run(command(backend, argv, rw=[], cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, uid=uid,
                                      tools=tools, ro_extra=ro_extra), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return err


def _backends() -> list[str]:
    """bwrap first; ``MINIDIST_SANDBOX=bwrap`` or ``=unshare`` asks for one (tests run both)."""
    want = os.environ.get("MINIDIST_SANDBOX", "").lower()
    return [want] if want in ("bwrap", "unshare") else ["bwrap", "unshare"]


# ----------------------------------------------------------------------------- environment
#: variables a sandboxed process may inherit (the grader's own environment may hold secrets)
PASS_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "NBGRADER_EXECUTION", "PYTHONHASHSEED", "JPY_SESSION_NAME", "CUDA_VISIBLE_DEVICES")
#: prefixes of variables a sandboxed process inherits too (``NCCL_*``: the GPU node's transport settings)
PASS_PREFIX = ("MINIDIST_", "NCCL_")


def inner_env(env, home: str, pristine: str, tag_var: str) -> dict:
    """The environment inside a sandbox: a private home, the pristine minidist first on the
    path, matplotlib's cache pre-filled, the job's kill tag, and nothing else of the grader's."""
    out = {k: v for k, v in env.items() if k in PASS_ENV or k.startswith(PASS_PREFIX) or k == tag_var}
    out.pop("MINIDIST_SOLUTIONS", None)
    out.pop("MINIDIST_BUGBANK", None)
    out.pop("MINIDIST_LABS", None)
    out.update(HOME=home, IPYTHONDIR=os.path.join(home, ".ipython"), MPLCONFIGDIR=os.path.join(home, ".mpl"),
               MPLBACKEND="Agg", JUPYTER_RUNTIME_DIR=os.path.join(home, ".runtime"), TMPDIR="/tmp",
               PYTHONPATH=pristine, PYTHONDONTWRITEBYTECODE="1", USER="student", LOGNAME="student")
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

    The worker sets :attr:`settings` (backend, home, pristine, tag_var, workdir, uid, tools,
    limit) before nbgrader runs. The kernel talks to nbclient over Unix sockets in its private home (``transport="ipc"``),
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
        give(s["home"], s.get("uid"))          # the connection file jupyter just wrote (mode 0600) included
        argv = command(s["backend"], kernel_cmd, rw=[(s["workdir"], cwd), s["home"]], cwd=cwd, env=env,
                       ro_extra=[s["pristine"]], uid=s.get("uid"), limit=s.get("limit"), tools=s.get("tools"))
        kw["env"] = outer_env(dict(kw.get("env") or os.environ), s["tag_var"])
        return await super()._async_launch_kernel(argv, **kw)

    async def _async_signal_kernel(self, signum: int) -> None:
        """An interrupt goes to the kernel itself, not to the process group jupyter started: there
        it would hit bwrap first, which dies of it and takes the whole sandbox along."""
        s = type(self).settings
        pid = getattr(getattr(self.provisioner, "process", None), "pid", None)
        kernel = _grandchild(pid) if s.get("backend") is not None and pid and signum == signal.SIGINT else None
        if kernel is None:
            return await super()._async_signal_kernel(signum)
        try:
            os.kill(kernel, signum)
        except OSError:
            pass

    signal_kernel = _async_signal_kernel          # AsyncKernelManager's are the coroutines themselves


def _grandchild(pid: int) -> int | None:
    """The sandboxed command: the child of the sandbox's first process, itself the child of ``pid``
    (bwrap or unshare; the drop step execs, it adds no process)."""
    from autograder.procs import _stat
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                parents[int(d)] = st[1]
    first = [p for p, pp in parents.items() if pp == pid]
    kernel = [p for p, pp in parents.items() if pp in first]
    return kernel[0] if len(first) == 1 and len(kernel) == 1 else None
