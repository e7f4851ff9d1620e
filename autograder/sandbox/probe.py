"""Which sandbox backend isolates here (:func:`probe`, once per batch), and whether a job's uid
reaches the interpreter, its packages and the pristine minidist inside it (:mod:`.reach`, before the
first job). See :mod:`autograder.sandbox`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from autograder.sandbox import reach
from autograder.sandbox.backend import (DEV_ENTRIES, DROP, INIT, Backend, command, describe, install_tools, job_uid,
                                        make_area)

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


class JobsCannotReach(Exception):
    """The sandbox works here, but a job's uid cannot reach what it needs (:mod:`autograder.sandbox.reach`):
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
    if turned_off():
        return None, "sandbox turned off (MINIDIST_SANDBOX=off)"
    if os.environ.get("MINIDIST_SANDBOX", "").lower() == "missing":     # as in a container without namespaces
        return None, "no sandbox possible here (MINIDIST_SANDBOX=missing: as where no namespace can be made)"
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
        wanted = reach.needs([os.path.join(p, "minidist", "__init__.py") for p in bound] + inside, programs)
        for name in _backends():
            exe = shutil.which(name)
            if not exe:
                reasons.append(f"{name}: not installed")
                continue
            backend = Backend(name, exe)
            walked = _run_inside(backend, ["/bin/sh", "-c", reach.WALK, "sh", *wanted], uid, tools, bound)
            found = reach.blocked(walked.stdout) if isinstance(walked, subprocess.CompletedProcess) else None
            if found is None:                      # the backend itself does not work here
                reasons.append(f"{name}: {_why(walked)}")
                continue
            if found:
                raise JobsCannotReach(reach.explain(found, uid))
            r = _run_inside(backend, [sys.executable, "-I", "-S", "-c", _PROBE, ",".join(sorted(DEV_ENTRIES)),
                                      *map(str, hidden)], uid, tools, bound)
            if isinstance(r, subprocess.CompletedProcess) and r.returncode == 0 and r.stdout.strip() == "ok":
                return backend, describe(backend)
            reasons.append(f"{name}: {_why(r)}")
    finally:
        if own_area:
            shutil.rmtree(area, ignore_errors=True)
    return None, "no sandbox possible here (" + "; ".join(reasons) + ")"


def turned_off() -> bool:
    """Whether the sandbox is turned off on purpose (``MINIDIST_SANDBOX=off``), not missing."""
    return os.environ.get("MINIDIST_SANDBOX", "").lower() in ("0", "off", "none", "no")


def reach_unsandboxed(area: Path, pristine: str | None = None, programs: list[str] = ()) -> None:
    """Where no sandbox works and the grader is root, its jobs still run as their own unprivileged uid
    (:func:`autograder.sandbox.backend.command`'s drop step), on the machine's folders as they are: raise
    :class:`JobsCannotReach` when that uid cannot reach the interpreter, its packages and the pristine
    minidist (falling back to root would hand the submission the grader's privileges)."""
    if os.geteuid() != 0:
        return
    tools = install_tools(area)
    uid = job_uid(uuid.uuid4().hex)
    wanted = reach.needs(([os.path.join(str(pristine), "minidist", "__init__.py")] if pristine else [])
                         + [os.path.join(tools, DROP.name)], programs)
    try:
        walked = subprocess.run(command(None, ["/bin/sh", "-c", reach.WALK, "sh", *wanted], rw=[], cwd="/tmp",
                                        env={"PATH": "/usr/bin:/bin"}, uid=uid, tools=tools),
                                capture_output=True, text=True, timeout=30, cwd="/tmp", env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as err:
        raise JobsCannotReach(f"autograder: no sandbox works here, and a job's uid could not be tried: {err}. "
                              f"Nothing was graded.") from None
    found = reach.blocked(walked.stdout)
    if found is None:
        raise JobsCannotReach(f"autograder: no sandbox works here, and a job's uid could not be tried "
                              f"({_why(walked)}). Nothing was graded.")
    if found:
        raise JobsCannotReach(reach.explain(found, uid, sandboxed=False))


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


