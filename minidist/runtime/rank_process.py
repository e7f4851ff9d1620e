"""What runs inside each rank's process: become a well-behaved child, join the group, run.

The parent (``minidist.launch``) watches from outside; this side makes that possible:
output goes to a file the parent relays, a page of shared memory says which operation the
rank is in, ``faulthandler`` dumps the Python stack on SIGUSR1 (even inside a blocking C++
recv), errors are written as short reports with the user's frames, results as files that
outlive the process (plain data, :mod:`minidist.runtime.plain_data`). A rank on a GPU binds to it before joining (``set_rank_device``), joins
the device-mapped group with its communicators made eagerly, and, once its result is safe on
disk, destroys the group again so that no communicator outlives its launch.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import json
import linecache
import mmap
import os
import re
import signal
import sys
import threading
import time
import traceback
import zlib

import torch
import torch.distributed as dist

from minidist import trace as _trace
from minidist.protocol import NOTEBOOK_CELL, RANK_DEFAULT_DEVICE_ENV
from minidist.trace.errors import cell_title
from minidist.runtime import plain_data
from minidist.runtime.cpu_affinity import pin_when_oversubscribed
from minidist.runtime.device import backend_for, prepare_nccl_environment, rank_device, set_rank_device

STARTUP_TIMEOUT = 120.0     # generous: 8 launches at once on 2 cores must not fail to start
DEFAULT_DEVICE_ENV = RANK_DEFAULT_DEVICE_ENV          # tests only: torch's default device inside every rank
STATUS_BYTES = 512          # [0] phase, [1:17] main-thread id (hex), [32:] current op
DESTROY_TIMEOUT = 10.0      # seconds a returned rank waits for its group's teardown before exiting anyway

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Parts of minidist whose frames a student never needs to read: how ranks start and report
# (runtime/), the tracer's wrappers, and the checks and harness that call the student's code.
_HIDDEN = tuple(os.path.join(_PACKAGE_DIR, p) for p in ("runtime" + os.sep, "trace", "checks" + os.sep,
                                                         "harness" + os.sep))


def is_library_frame(filename: str) -> bool:
    """Frames a student does not need to read: torch, and minidist's runtime, tracer, checks, harness."""
    if os.path.abspath(filename).startswith(_HIDDEN):
        return True
    return "/torch/" in filename or "/threading.py" in filename or filename.startswith("<frozen")


def student_frames(frames, filename=lambda f: f.filename) -> list:
    """The frames a student reads: no library frame, and, when any frame is their own code, none of
    minidist's either (a lab's stand-ins for their other functions, the models a check hands them)."""
    kept = [f for f in frames if not is_library_frame(filename(f))]
    theirs = [f for f in kept if not os.path.abspath(filename(f)).startswith(_PACKAGE_DIR + os.sep)]
    return theirs or kept


def format_frame(filename, line, func):
    shown = (cell_title(filename, line) if NOTEBOOK_CELL.search(filename)  # by its title
             else f'File "{filename}"')
    src = linecache.getline(filename, line).strip()
    return f'{shown}, line {line}, in {func}' + (f"\n    {src}" if src else "")


def indent(lines):
    return "\n".join("  " + l.replace("\n", "\n  ") for l in lines)


def rank_main(rank, world_size, kind, run_dir, timeout, fn, args, kwargs, forked=False, dump_dir=None) -> int:
    """Body of every rank (``kind``: "cpu" or "cuda"). Returns the process exit code; never raises."""
    try:
        _become_rank_process(rank, run_dir, forked)
        # More ranks than cores: each rank's threads stay on one core (gloo's are made below).
        pin_when_oversubscribed(rank, world_size, offset=zlib.crc32(os.path.basename(run_dir).encode()))
        status = _StatusPage(os.path.join(run_dir, f"rank{rank}.status"))
        _trace.set_op_listener(status.set_op)
        # A forked child inherits the parent's OpenMP pool in a state libgomp cannot reuse:
        # once the parent has run a parallel region, the child's first one hangs (measured:
        # a 1-rank launch after a 2-thread matmul). One thread never enters that pool.
        torch.set_num_threads(1 if forked else max(1, (os.cpu_count() or 1) // world_size))
        # One node: the local rank is the rank, so rank r takes visible GPU r.
        dev = rank_device(kind, rank)
        set_rank_device(dev)
        if kind == "cuda":
            prepare_nccl_environment(os.path.join(dump_dir, "rank") if dump_dir else None)
        store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
        _wait_for_all_ranks(store, world_size)
        # Everyone is here, so connecting is quick even under load: the group can carry the
        # user's timeout, and a stuck op raises on its own before the watchdog has to step in.
        # device_id binds the group to this GPU and builds its NCCL communicator now, not on
        # the first collective (where a failure would look like the user's fault).
        dist.init_process_group(backend_for(kind), store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout),
                                **({"device_id": dev} if kind == "cuda" else {}))
        # Without this a rank that finishes fast can exit while a peer is still connecting
        # to it, and the peer fails in init with "Connection closed by peer".
        dist.barrier()
        status.set_phase(1)
        # Tests of device discipline (tests/test_device_discipline.py): inputs stay on the CPU while
        # anything made without ``device=`` lands on ``meta`` and fails, as it would on a GPU rank.
        emulated = os.environ.get(DEFAULT_DEVICE_ENV)
        if emulated:
            torch.set_default_device(emulated)
    except BaseException:
        return _report_exception(rank, run_dir, "failed to start")
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        return _report_exception(rank, run_dir, "raised")
    try:
        data = plain_data.dumps(result)          # never a pickle: the launcher must not run what it reads
        tmp = os.path.join(run_dir, f"rank{rank}.result.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(run_dir, f"rank{rank}.result"))
    except Exception as err:
        _write_error(rank, run_dir, f"rank {rank}: returned a value that cannot be sent back: {err}")
        return 1
    sys.stdout.flush()
    destroy_group(DESTROY_TIMEOUT)
    return 0


def destroy_group(limit: float) -> bool:
    """Destroy this rank's process group (its NCCL communicators), waiting at most ``limit`` s.

    Runs in a daemon thread: a teardown stuck on a peer must not turn a finished launch into a
    timed-out one; the process exits right after and takes a stuck teardown with it. True when done."""
    if not dist.is_initialized():
        return True
    worker = threading.Thread(target=_destroy_quietly, name="minidist-destroy", daemon=True)
    worker.start()
    worker.join(limit)
    return not worker.is_alive()


def _destroy_quietly():
    try:
        dist.destroy_process_group()
    except Exception:       # the result is already written; a failed teardown changes nothing for it
        pass


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
        self.page = mmap.mmap(fd, STATUS_BYTES)
        os.close(fd)
        self.page[1:17] = f"{threading.main_thread().ident:#x}".encode()[:16].ljust(16, b"\0")

    def set_phase(self, phase):
        self.page[0] = phase

    def set_op(self, op):
        data = (op or "").encode()[: STATUS_BYTES - 33] + b"\0"
        self.page[32:32 + len(data)] = data


def _report_exception(rank, run_dir, verb) -> int:
    etype, err, tb = sys.exc_info()
    if isinstance(err, SystemExit):
        _write_error(rank, run_dir, f"rank {rank}: called sys.exit({err.code!r}) inside the launched function")
        return 1
    frames = student_frames(traceback.extract_tb(tb))
    lines = [format_frame(f.filename, f.lineno, f.name) for f in frames[-6:]]
    message = "".join(traceback.format_exception_only(etype, err)).strip()
    message = re.sub(r"^(minidist\.(?:\w+\.)+|torch\.distributed\.\w*\.?)(?=\w+(Error|Timeout|Gone|Operation)\b)", "", message)
    message = message.split("\nException raised from")[0]      # C++ stack frames follow that line
    _write_error(rank, run_dir, f"rank {rank} {verb}: {message}\n" + indent(lines))
    return 1


def _write_error(rank, run_dir, text):
    with open(os.path.join(run_dir, f"rank{rank}.error"), "w") as f:
        f.write(text)


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        # torch.save writes a view's whole storage; copy so a small slice stays small.
        return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def spawn_entry():
    """Entry point of a fresh-interpreter rank (``start_method='spawn'``)."""
    run_dir, rank, world_size, kind, timeout = sys.argv[1:6]
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
        code = rank_main(rank, int(world_size), kind, run_dir, float(timeout), fn, args, kwargs,
                         dump_dir=meta.get("dump_dir"))
    sys.stdout.flush()
    os._exit(code)
