"""The sandbox gives a submission no privilege on the machine (autograder/sandbox.py,
sandbox_drop.py, sandbox_init.py), with each backend that works here: a process started through
``sandbox.command`` tries what a submission run by a root grader once could (write
``kernel.core_pattern``, other sysctls, the machine's ``/dev``, the cgroup file systems under
``/sys``), and every attempt fails while the machine's values stay as they were.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import sandbox

ATTEMPT = r"""
import json, os, resource
tried = {}
for path, value in (("/proc/sys/kernel/core_pattern", "|/tmp/minidist-pwn %p"), ("/proc/sys/kernel/pid_max", "4194000"),
                    ("/proc/sys/vm/overcommit_memory", "1"), ("/dev/minidist-owned", "x"),
                    ("/sys/fs/cgroup/minidist-owned", "x"), ("/sys/fs/cgroup/pids/minidist-owned", "x"),
                    ("/sys/kernel/mm/transparent_hugepage/enabled", "never")):
    try:
        with open(path, "w") as f:
            f.write(value)
        tried[path] = "written"
    except OSError as err:
        tried[path] = err.strerror
try:
    os.mknod("/dev/minidist-node")
    tried["mknod"] = "made"
except OSError as err:
    tried["mknod"] = err.strerror
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "caps": [status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd")],
                  "no_new_privs": status["NoNewPrivs"].strip(), "dev": sorted(os.listdir("/dev")), "tried": tried,
                  "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0], "nice": os.nice(0),
                  "address_space": resource.getrlimit(resource.RLIMIT_AS)[0]}))
"""
WATCHED = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/pid_max", "/proc/sys/vm/overcommit_memory")


def _machine_state() -> dict:
    state = {p: Path(p).read_text() for p in WATCHED if os.path.exists(p)}
    state["/dev"] = sorted(os.listdir("/dev"))
    if os.path.isdir("/sys/fs/cgroup"):
        state["/sys/fs/cgroup"] = sorted(os.listdir("/sys/fs/cgroup"))
    return state


def _backends():
    return [name for name in ("bwrap", "unshare") if shutil.which(name)]


@pytest.mark.parametrize("name", _backends() or ["none"])
def test_a_sandboxed_process_cannot_touch_the_machine(name, tmp_path, monkeypatch):
    if name == "none":
        pytest.skip("neither bwrap nor unshare is installed")
    monkeypatch.setenv("MINIDIST_SANDBOX", name)
    area = sandbox.make_area()
    try:
        backend, what = sandbox.probe(area=area)
        if backend is None:
            pytest.skip(f"{name} cannot isolate here: {what}")
        assert backend.name == name and "never root" in what and "no capabilities" in what, what
        before = _machine_state()
        argv = sandbox.command(backend, [sys.executable, "-I", "-S", "-c", ATTEMPT], rw=[], cwd="/tmp",
                               env={"PATH": "/usr/bin:/bin"}, uid=sandbox.job_uid("ab" * 8),
                               tools=sandbox.install_tools(area))
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        seen = json.loads(r.stdout)
        after = _machine_state()
    finally:
        shutil.rmtree(area, ignore_errors=True)
    assert after == before
    assert seen["uid"] != 0 and seen["euid"] != 0
    assert all(int(c, 16) == 0 for c in seen["caps"]) and seen["no_new_privs"] == "1", seen
    assert all(v not in ("written", "made") for v in seen["tried"].values()), seen["tried"]
    assert set(seen["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "shm", "fd", "stdin", "stdout",
                                "stderr", "pts", "ptmx", "core"}, seen["dev"]
    lim = sandbox.limits()
    assert seen["address_space"] == lim["address_space"] and seen["nice"] >= lim["nice"]
    assert seen["nproc"] != -1                # RLIM_INFINITY: no cap on the job's tasks


def test_a_root_grader_gives_each_job_its_own_unprivileged_uid():
    if os.geteuid() != 0:
        assert sandbox.job_uid("0123456789abcdef") is None      # an ordinary grader keeps its own uid
        return
    uids = {sandbox.job_uid(f"{k:032x}") for k in (1, 2, 3)}
    assert len(uids) == 3 and all(u >= sandbox.UID_BASE for u in uids)
