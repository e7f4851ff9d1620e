"""The sandbox's backends (bubblewrap, ``unshare``) and how one process is started in a sandbox
(:func:`command`): the read-only and writable binds, the drop to the job's uid, its limits, the GPU
devices when asked; and the per-batch *area* holding what the jobs' uids may reach of the grader's
files (:func:`make_area`, :func:`give`, :func:`install_tools`). See :mod:`autograder.sandbox`.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

INIT = Path(__file__).resolve().with_name("init.py")
ROOT_MOUNTPOINT = "/tmp/minidist-sandbox-root"      # each sandbox mounts its own tmpfs here, privately
SYSTEM_RO = ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/etc", "/sys"]
DROP = Path(__file__).resolve().with_name("drop.py")
INNER_ID = 1000                                     # the submission's uid/gid inside (init.INNER_ID)
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
    its ``CUDA_VISIBLE_DEVICES`` (:func:`autograder.grading.grade.gpu_slots`)."""
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
    """The argv that runs ``argv`` in a sandbox, with the drop step (``uid``: the job's, see
    :func:`job_uid`; ``limit``: :func:`limits`; ``tools``: the folder holding copies of ``init.py`` and
    ``drop.py`` that uid can read, :func:`install_tools`).

    Without a backend (no sandbox works here) the drop step alone: the job's limits and, for a grader
    started as root, the job's unprivileged uid, so that student code never runs as root and cannot read
    what the grader keeps to itself (its files owned by root, mode 0700: Gradescope's containers).

    A grader running as root builds the sandbox as root (it can reach the interpreter wherever
    it lives) and drops to ``uid`` inside, before ``argv``; an ordinary grader drops first (limits
    only) and lets the backend's user namespace build it. ``rw`` holds paths, each seen at its own
    place, or ``(source, seen_at)`` pairs."""
    tools = str(tools or Path(__file__).resolve().parent)
    root = os.geteuid() == 0
    if backend is None:
        if uid is None and limit is None:
            return list(argv)
        cfg = dict(limit or limits(), uid=uid, gid=uid)
        if gpu_devices():
            cfg["address_space"] = None
        return [sys.executable, "-I", "-S", os.path.join(tools, DROP.name), json.dumps(cfg), "--", *argv]
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


def install_tools(area: Path) -> str:
    """Copies of ``init.py`` and ``drop.py`` the jobs' uids can read (the
    repository may be private), in ``area/bin``."""
    dest = Path(area) / "bin"
    dest.mkdir(exist_ok=True)
    os.chmod(dest, 0o755)                   # whatever the grader's umask
    for f in (INIT, DROP):
        shutil.copyfile(f, dest / f.name)
        os.chmod(dest / f.name, 0o644)
    return str(dest)


