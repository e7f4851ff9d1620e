"""The sandbox gives a submission no privilege on the machine (autograder/sandbox.py,
sandbox_drop.py, sandbox_init.py), with each backend that works here: a process started through
``autograder.sandbox.backend.command`` tries what a submission run by a root grader once could (write
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

from autograder.sandbox import backend as sandbox
from autograder.sandbox.home import inner_env
from autograder.sandbox.probe import probe

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
        backend, what = probe(area=area)
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


def _unreadable_ancestor(path: str) -> str | None:
    """The highest folder above ``path`` (or ``path`` itself) that others cannot traverse (a 0700 /root,
    a ``mktemp -d`` folder holding the clone)."""
    parts = Path(path).parts
    for k in range(2, len(parts) + 1):
        d = str(Path(*parts[:k]))
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def reachable_for_everyone(paths, keep: Path) -> str:
    """Shell commands for a private mount namespace (as root) in which every one of ``paths`` is
    reachable by any uid, as on a course server where the grading user owns its course: each path is
    kept aside by a bind mount, a traversable tmpfs covers the private folder above it, and the path
    is bound back in place. Paths inside one another are kept once (the outer one)."""
    paths = sorted({os.path.realpath(p) for p in paths}, key=len)
    paths = [p for i, p in enumerate(paths) if not any(p.startswith(q + "/") for q in paths[:i])]
    blocked = {p: _unreadable_ancestor(p) for p in paths}
    moves = [(p, keep / str(i)) for i, p in enumerate(paths) if blocked[p]]
    steps = [f"mkdir -p {k} && mount --bind {p} {k}" for p, k in moves]
    steps += [f"mount -t tmpfs -o mode=0755 tmpfs {b}" for b in dict.fromkeys(blocked[p] for p, _ in moves)]
    steps += [f"mkdir -p {p} && mount --bind {k} {p}" for p, k in moves]
    return " && ".join(["umask 022"] + steps)


def test_a_grader_started_as_an_ordinary_user_still_works(tmp_path):
    """We run as root here: grade the honest solution and the root attack as an unprivileged uid
    (setpriv), in a private mount namespace where the private folders above the interpreter (this
    machine's /root/.pyenv), the virtual environment and the course (a clone in a ``mktemp -d``
    folder) are made traversable, as they are for the user who owns them on a course server."""
    if os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare")):
        pytest.skip("needs root, setpriv and unshare to start the grader as another user")
    from attack_bank import ROOT
    from autograder import REPO
    from autograder.course.cells import read_nb, solution_submission, write_nb
    from autograder.course.template import build_course
    from autograder_fixtures import LAB, SOLUTIONS
    from nbformat.v4 import new_code_cell
    uid = 1_800_000_000 + os.getpid() % 1000
    box = Path(sandbox.make_area())
    try:
        os.chmod(box, 0o755)
        course = build_course([LAB], box / "course", solutions=SOLUTIONS)
        sol = solution_submission(read_nb(course / "source" / LAB / f"{LAB}.ipynb"),
                                  read_nb(course / "release" / LAB / f"{LAB}.ipynb"))
        write_nb(sol, box / "subs" / "honest" / LAB / f"{LAB}.ipynb")
        sol.cells.insert(2, new_code_cell(ROOT))
        write_nb(sol, box / "subs" / "root" / LAB / f"{LAB}.ipynb")
        (box / "home").mkdir()
        for root, dirs, files in os.walk(box):
            for name in dirs + files + ["."]:
                os.chown(os.path.join(root, name), uid, uid)
        grade = (f"exec setpriv --reuid={uid} --regid={uid} --clear-groups env HOME={box}/home "
                 f"MINIDIST_SOLUTIONS={SOLUTIONS} MINIDIST_LABS={box}/labs "
                 f"PATH={os.path.dirname(sys.executable)}:/usr/bin:/bin "
                 f"{sys.executable} -m autograder grade {box}/subs --out {box}/out --jobs 2 --lab {LAB} "
                 f"--cell-timeout 20 --wall-timeout 150 --quiet --sandbox")
        script = reachable_for_everyone([sys.base_prefix, sys.prefix, REPO], box / "keep") + " && " + grade
        before = {p: Path(p).read_text() for p in WATCHED if os.path.exists(p)}
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                           capture_output=True, text=True, timeout=400, cwd=str(box))
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        assert f"grader's uid {uid} outside, 1000 inside" in r.stdout, r.stdout[-2000:]
        assert {p: Path(p).read_text() for p in WATCHED if os.path.exists(p)} == before
        import csv
        grades = {row["student_id"]: float(row["score"]) for row in csv.DictReader(open(box / "out" / "grades.csv"))}
        assert grades == {"honest": 3.0, "root": 3.0}, grades
        nb = read_nb(box / "out" / "autograded" / "root" / LAB / f"{LAB}.ipynb")
        said = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        assert said.count("refused ") == 6 and "wrote " not in said, said
    finally:
        shutil.rmtree(box, ignore_errors=True)


DEVICES = r"""
import json, os
st = os.statvfs("/dev/shm")
print(json.dumps({"dev": sorted(os.listdir("/dev")), "shm": st.f_blocks * st.f_frsize,
                  "env": sorted(k for k in os.environ if k in ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "GRADER_SECRET"))}))
"""


def test_both_backends_show_the_same_devices_the_gpus_only_when_asked_and_a_big_shm(monkeypatch):
    """Issue 26: which /dev entries exist inside, the size of /dev/shm and the GPU variables that
    reach a kernel do not depend on whether bwrap or unshare built the sandbox."""
    seen = {}
    for name in _backends():
        monkeypatch.setenv("MINIDIST_SANDBOX", name)
        area = sandbox.make_area()
        try:
            backend, what = probe(area=area)
            if backend is None:
                continue
            for asked in ("0", "1"):
                monkeypatch.setenv("MINIDIST_SANDBOX_GPU", asked)
                env = inner_env({"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "2,3", "NCCL_DEBUG": "WARN",
                                         "GRADER_SECRET": "x"}, "/tmp", "/tmp", "TAG")
                argv = sandbox.command(backend, [sys.executable, "-I", "-S", "-c", DEVICES], rw=[], cwd="/tmp",
                                       env=env, uid=sandbox.job_uid("cd" * 8), tools=sandbox.install_tools(area))
                r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                assert r.returncode == 0, r.stderr[-2000:]
                seen[name, asked] = json.loads(r.stdout)
                gpus = {os.path.basename(d) for d in sandbox.gpu_devices()}
                assert set(seen[name, asked]["dev"]) == set(sandbox.DEV_ENTRIES) | gpus, (name, asked, seen)
        finally:
            shutil.rmtree(area, ignore_errors=True)
    if not seen:
        pytest.skip("no sandbox backend works here")
    for asked in ("0", "1"):
        assert len({json.dumps(v) for (_, a), v in seen.items() if a == asked}) == 1, seen      # parity
    if os.path.exists("/dev/nvidiactl"):
        assert "nvidiactl" in seen[next(k for k in seen if k[1] == "1")]["dev"]
    assert not any(d.startswith(("nvidia", "dri", "kfd")) for (_, a), v in seen.items() if a == "0" for d in v["dev"])
    assert all(v["shm"] == sandbox.shm_bytes() >= 2 << 30 for v in seen.values()), seen   # NCCL at 8 ranks: ~1.6 GiB
    assert all(v["env"] == ["CUDA_VISIBLE_DEVICES", "NCCL_DEBUG"] for v in seen.values()), seen
