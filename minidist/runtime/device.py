"""Where a rank's tensors live: the one device model every part of minidist asks.

A rank computes on one device. On a CPU machine that is ``cpu`` and the process group is
gloo. On a GPU node each rank owns one GPU (``cuda:<local rank>``, counted among the GPUs in
``CUDA_VISIBLE_DEVICES``, so students sharing a node each see only their own), and its process
group is *device-mapped*, ``"cpu:gloo,cuda:nccl"``: CUDA tensors travel over NCCL, and the
small CPU tensors and pickled objects that control code exchanges keep working over gloo.

* :func:`device` — this rank's device (``cpu`` outside a launch, or on CPU ranks). Code that
  makes a tensor passes ``device=`` explicitly, its inputs' device first, else this one.
* :func:`resolve_device` — what ``launch(..., device=None|"cpu"|"cuda")`` asks for, checked
  against the machine before any rank starts.
* :func:`synchronize` and :func:`timed` — CUDA kernels run asynchronously to the host, so a
  time read without synchronising measures the launch, not the work. Every timing in minidist
  goes through :func:`timed`.

Nothing here initialises CUDA in the calling process: the GPU count comes from NVML
(``torch.cuda.device_count``), so a parent can still fork its ranks. Only where NVML cannot
count (no NVML library, MIG) does torch fall back to the CUDA runtime, which initialises the
driver here; :func:`parent_initialised_cuda` then says so and the launcher spawns instead.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import time
import warnings

import torch
import torch.distributed as dist

DEVICES = ("cpu", "cuda")

# Set once per rank by the launcher (or by init_from_env under torchrun).
_rank_device: torch.device | None = None


def device() -> torch.device:
    """The device this rank's tensors live on: ``cuda:<i>`` on a GPU rank, ``cpu`` otherwise."""
    return _rank_device if _rank_device is not None else torch.device("cpu")


def set_rank_device(dev: torch.device | str | None) -> None:
    """The launcher's hook: this process is a rank on ``dev`` (None: back to the CPU)."""
    global _rank_device
    _rank_device = torch.device(dev) if dev is not None else None
    if _rank_device is not None:
        if _rank_device.type == "cuda":
            torch.cuda.set_device(_rank_device)
        # Ampere and later round fp32 matmuls to TF32 when allowed; the checks' fp32
        # tolerances (1e-5) assume true fp32, so it is switched off explicitly, on every rank
        # (a forked rank would otherwise inherit whatever its parent chose).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


# True once visible_gpus() had to ask the CUDA runtime (NVML could not count): the driver is
# then initialised in this process and a fork would give ranks a CUDA they cannot use.
_counted_with_cuda_runtime = False


def visible_gpus() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES applied), counted without initialising CUDA."""
    global _counted_with_cuda_runtime
    if not dist.is_nccl_available() or not torch.backends.cuda.is_built():
        return 0
    try:
        with warnings.catch_warnings():     # "Can't initialize NVML": a warning would fail a graded cell
            warnings.simplefilter("ignore")
            if not torch.cuda.is_initialized():
                # torch.cuda.device_count() asks NVML first and the CUDA runtime only if NVML fails
                nvml = getattr(torch.cuda, "_device_count_nvml", None)
                if nvml is None or nvml() < 0:
                    _counted_with_cuda_runtime = True
            return torch.cuda.device_count()
    except Exception:       # a broken driver reads as no GPU: the CPU path still works
        return 0


def parent_initialised_cuda() -> bool:
    """Whether CUDA is initialised in this process, so that forked children could not use it."""
    return torch.cuda.is_initialized() or _counted_with_cuda_runtime or _driver_initialised()


CUDA_ERROR_NOT_INITIALIZED = 3


def _driver_initialised() -> bool:
    """Whether anything in this process initialised the CUDA driver (cuInit) without torch
    knowing: ``torch.cuda.is_available()`` does (it asks the CUDA runtime unless
    PYTORCH_NVML_BASED_CUDA_CHECK is set), and so does ``torch.cuda.device_count()`` where NVML
    cannot count; ``torch.cuda.is_initialized()`` stays False, yet a forked rank's first CUDA
    call fails with "initialization error" (measured on an H100, torch 2.11). The driver library
    answers: before cuInit, cuDeviceGetCount returns CUDA_ERROR_NOT_INITIALIZED. A process that
    never loaded it cannot have initialised it, and asking never loads it."""
    try:
        with open("/proc/self/maps") as maps:
            if "libcuda.so" not in maps.read():
                return False
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:             # no /proc (not Linux) or no driver: nothing was initialised
        return False
    count = ctypes.c_int(0)
    return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def resolve_device(requested: str | None, world_size: int, gpus: int | None = None) -> str:
    """``"cpu"`` or ``"cuda"`` for a launch of ``world_size`` ranks; a clear error before any rank starts.

    ``None`` picks ``cuda`` when there is one visible GPU per rank, else ``cpu``."""
    gpus = visible_gpus() if gpus is None else gpus
    if requested is None:
        return "cuda" if gpus >= world_size else "cpu"
    if isinstance(requested, torch.device):
        requested = requested.type
    if requested not in DEVICES:
        raise ValueError(f"device must be 'cpu', 'cuda' or None, got {requested!r}")
    if requested == "cuda" and gpus < world_size:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ValueError(f"device='cuda' needs one GPU per rank: world_size={world_size}, but this machine "
                         f"has {gpus} visible GPU(s){where}; use a smaller world_size or device='cpu'")
    return requested


# What a CUDA rank's environment needs before its process group exists (ProcessGroupNCCL reads
# these when it is built; names as in torch 2.4-2.13, the flight recorder's newer names too):
# * blocking wait: without it ``work.wait()`` only makes the CUDA stream wait and returns, so a
#   rank stuck in recv moves on and hangs later in some unrelated copy, and on a timeout the
#   watchdog kills the process (SIGABRT) instead of raising. With it the op that never
#   completes raises DistBackendError in the rank after the group timeout, at the user's line.
# * the flight recorder: the last collectives of every rank, dumped on a timeout.
NCCL_BLOCKING_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
FLIGHT_RECORDER_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
FLIGHT_RECORDER_FILE_ENV = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


def prepare_nccl_environment(dump_prefix: str | None = None) -> None:
    """Set, unless the user already has, what makes a hung NCCL op raise and leave a trace.

    ``dump_prefix``: where the flight recorder writes (``<prefix><rank>``)."""
    for key, value in {**NCCL_BLOCKING_ENV, **FLIGHT_RECORDER_ENV}.items():
        os.environ.setdefault(key, value)
    if dump_prefix is not None:
        for key in FLIGHT_RECORDER_FILE_ENV:
            os.environ.setdefault(key, dump_prefix)


def backend_for(kind: str) -> str:
    """The process-group backend for ranks on ``kind``: gloo on CPU, device-mapped on GPUs."""
    return "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device of the rank with this local rank, for a launch on ``kind``."""
    return torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")


def synchronize(dev: torch.device | str | None = None) -> None:
    """Wait until the work queued on ``dev`` (default: this rank's device) has finished."""
    dev = torch.device(dev) if dev is not None else device()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@contextlib.contextmanager
def timed(dev: torch.device | str | None = None):
    """``with timed() as t: ...`` then ``t.seconds``: wall time of the block's work on ``dev``,
    synchronised at both ends (on the CPU, a plain ``perf_counter`` difference)."""
    class Elapsed:
        seconds = float("nan")

    result = Elapsed()
    synchronize(dev)
    start = time.perf_counter()
    try:
        yield result
    finally:
        synchronize(dev)
        result.seconds = time.perf_counter() - start
