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

Under ``torchrun`` (RANK/WORLD_SIZE set) ``launch`` runs ``fn`` on this process's rank
only and gathers every rank's result, so the same lab code scales to many nodes.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

from minidist import trace as _trace

DEFAULT_TIMEOUT = 60.0      # seconds of user code, counted once every rank has joined
STARTUP_TIMEOUT = 120.0     # generous: 8 launches at once on 2 cores must not fail to start
FAILURE_GRACE = 1.0         # after a first failure, time for the others to report theirs
WATCHDOG_GRACE = 1.5        # the group's own timeout fires first and names the op; this catches the rest
MAX_CPU_WORLD = 64
OUTPUT_LIMIT = 100_000      # characters relayed per rank; the rest is counted, not printed
_STATUS_BYTES = 512         # [0] phase, [1:17] main-thread id (hex), [32:] current op
_NOISE = re.compile(r"^(\[rank\d+\]:)?\[[WIE]\d{4} |^\s*warnings\.warn\(")


class LaunchError(RuntimeError):
    """One or more ranks failed or hung. ``failures`` maps rank -> its report."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


# ----------------------------------------------------------------------------- parent
def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT,
           start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results by rank."""
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if os.environ.get("TORCHELASTIC_RUN_ID") and "RANK" in os.environ:
        return _launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout)
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
                r.start_fork(lambda job=job: _rank_main(*job, fn, args, kwargs, forked=True))
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
            f.write(b"\0" * _STATUS_BYTES)
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
        cmd = [sys.executable, "-c", "from minidist.launch import _spawn_entry; _spawn_entry()",
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
            raw = f.read(_STATUS_BYTES)
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
            if (not line and final) or _NOISE.search(line):
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
        report = _failure_report(r, timeout, user_clock_started) if r in stuck or r.exit != ("code", 0) else None
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


def _failure_report(r: _Rank, timeout: float, user_clock_started: bool) -> str:
    if os.path.exists(r.path("error")):
        with open(r.path("error")) as f:
            return f.read().rstrip()
    kind, num = r.exit or ("", 0)
    if kind == "killed":    # we killed it: it was stuck
        _, main_thread, _ = r.status()
        op = r.op_when_stopped
        frames = _stack_frames(r.path("stack"), main_thread)
        where = f"blocked in {op}" if op else "busy in Python code (no communication in flight)"
        if not user_clock_started:
            where = "still starting up (process group not joined)"
        return f"rank {r.rank}: {where}\n" + _indent(frames or ["(no Python stack available)"])
    if kind == "signal":
        name = signal.Signals(num).name if num in signal.Signals._value2member_map_ else str(num)
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if num == signal.SIGKILL else ""
        tail = _tail(r.path("out"))
        return f"rank {r.rank}: killed by signal {name}{hint}" + (f"\n{_indent(tail)}" if tail else "")
    if kind == "code" and num == 0:
        return f"rank {r.rank}: exited without returning a result (os._exit(0) inside the function?)"
    tail = _tail(r.path("out"))
    return f"rank {r.rank}: exited with code {num} without an exception (os._exit()?)" + (f"\n{_indent(tail)}" if tail else "")


def _stack_frames(path, main_thread):
    """The main thread's frames from a faulthandler dump, innermost last, library frames dropped."""
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        text = f.read()
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    chosen = next((b for b in blocks if main_thread and main_thread.lower() in b.lower()), blocks[-1] if blocks else "")
    frames = []
    for m in re.finditer(r'File "(.+?)", line (\d+) in (\S+)', chosen):    # innermost first
        filename, line, func = m.group(1), int(m.group(2)), m.group(3)
        if filename == __file__:
            break           # _rank_main: what lies beyond is the parent's stack, inherited by fork
        if not _is_library_frame(filename):
            frames.append(_format_frame(filename, line, func))
    return list(reversed(frames))[-6:]


def _is_library_frame(filename: str) -> bool:
    return (filename in (__file__, _trace.__file__) or "/torch/" in filename or "/threading.py" in filename
            or filename.startswith("<frozen"))


def _format_frame(filename, line, func):
    import linecache
    shown = "notebook cell" if re.search(r"ipykernel_\d+|<ipython-input", filename) else filename
    src = linecache.getline(filename, line).strip()
    return f'File "{shown}", line {line}, in {func}' + (f"\n    {src}" if src else "")


def _tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f.readlines() if not _NOISE.search(l)]
    except OSError:
        return []
    return lines[-n:]


def _indent(lines):
    return "\n".join("  " + l.replace("\n", "\n  ") for l in lines)


# ------------------------------------------------------------------------------ child
def _rank_main(rank, world_size, backend, run_dir, timeout, fn, args, kwargs, forked=False) -> int:
    """Body of every rank. Returns the process exit code; never raises."""
    try:
        _become_rank_process(rank, run_dir, forked)
        status = _StatusPage(os.path.join(run_dir, f"rank{rank}.status"))
        _trace.set_op_listener(status.set_op)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
        _wait_for_all_ranks(store, world_size)
        # Everyone is here, so connecting is quick even under load: the group can carry the
        # user's timeout, and a stuck op raises on its own before the watchdog has to step in.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # Without this a rank that finishes fast can exit while a peer is still connecting
        # to it, and the peer fails in init with "Connection closed by peer".
        dist.barrier()
        status.set_phase(1)
    except BaseException:
        return _report_exception(rank, run_dir, "failed to start")
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        return _report_exception(rank, run_dir, "raised")
    try:
        tmp = os.path.join(run_dir, f"rank{rank}.result.tmp")
        torch.save(_to_cpu(result), tmp)
        os.replace(tmp, os.path.join(run_dir, f"rank{rank}.result"))
    except Exception as err:
        _write_error(rank, run_dir, f"rank {rank}: returned a value that cannot be sent back "
                                    f"({type(err).__name__}: {err}); return tensors, numbers, lists or dicts")
        return 1
    sys.stdout.flush()
    return 0


def _become_rank_process(rank, run_dir, forked):
    if forked:
        os.setpgid(0, 0)    # own process group: killpg reaches anything this rank starts
        out = os.open(os.path.join(run_dir, f"rank{rank}.out"), os.O_WRONLY | os.O_APPEND)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    # A forked notebook kernel's sys.stdout talks to a zmq thread that does not exist here.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    faulthandler.enable(file=sys.stderr)
    stack_file = open(os.path.join(run_dir, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _become_rank_process.stack_file = stack_file    # keep it open for the process's life


def _wait_for_all_ranks(store, world_size):
    """A rendezvous with the generous startup timeout, before gloo's own strict one starts."""
    store.add("minidist/arrived", 1)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while store.add("minidist/arrived", 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {world_size} ranks started within {STARTUP_TIMEOUT:g} s")
        time.sleep(0.002)


class _StatusPage:
    """A shared page the parent reads to learn what this rank is blocked in."""

    def __init__(self, path):
        fd = os.open(path, os.O_RDWR)
        self.page = mmap.mmap(fd, _STATUS_BYTES)
        os.close(fd)
        self.page[1:17] = f"{threading.main_thread().ident:#x}".encode()[:16].ljust(16, b"\0")

    def set_phase(self, phase):
        self.page[0] = phase

    def set_op(self, op):
        data = (op or "").encode()[: _STATUS_BYTES - 33] + b"\0"
        self.page[32:32 + len(data)] = data


def _report_exception(rank, run_dir, verb) -> int:
    etype, err, tb = sys.exc_info()
    if isinstance(err, SystemExit):
        _write_error(rank, run_dir, f"rank {rank}: called sys.exit({err.code!r}) inside the launched function")
        return 1
    frames = [f for f in traceback.extract_tb(tb) if not _is_library_frame(f.filename)]
    lines = [_format_frame(f.filename, f.lineno, f.name) for f in frames[-6:]]
    message = "".join(traceback.format_exception_only(etype, err)).strip()
    message = re.sub(r"^(minidist\.\w+\.|torch\.distributed\.\w*\.?)(?=\w+(Error|Timeout|Gone|Operation)\b)", "", message)
    message = message.split("\nException raised from")[0]      # C++ stack frames follow that line
    _write_error(rank, run_dir, f"rank {rank} {verb}: {message}\n" + _indent(lines))
    return 1


def _write_error(rank, run_dir, text):
    with open(os.path.join(run_dir, f"rank{rank}.error"), "w") as f:
        f.write(text)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        # torch.save writes a view's whole storage; copy so a small slice stays small.
        return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _spawn_entry():
    """Entry point of a fresh-interpreter rank (``start_method='spawn'``)."""
    run_dir, rank, world_size, backend, timeout = sys.argv[1:6]
    rank = int(rank)
    code = 1
    try:
        with open(os.path.join(run_dir, "payload.json")) as f:
            meta = json.load(f)
        sys.path[:] = meta["sys_path"]
        os.chdir(meta["cwd"])
        import cloudpickle
        with open(os.path.join(run_dir, "payload.pkl"), "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
    except BaseException:
        _become_rank_process(rank, run_dir, forked=False)
        code = _report_exception(rank, run_dir, "could not load the function to run")
    else:
        code = _rank_main(rank, int(world_size), backend, run_dir, float(timeout), fn, args, kwargs)
    sys.stdout.flush()
    os._exit(code)


# --------------------------------------------------------------------------- torchrun
def init_from_env(backend: str | None = None, timeout: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env() needs {', '.join(missing)} in the environment: run under torchrun")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    _trace.install()
    return dist.get_rank(), dist.get_world_size()


def _launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout):
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: they must match")
    init_from_env(backend, timeout)
    result = _to_cpu(fn(*args, **kwargs))
    gathered = [None] * env_world
    dist.all_gather_object(gathered, result)
    return gathered
