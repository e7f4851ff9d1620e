"""Under torchrun: the same ``launch(fn, N)`` call, one rank per process, across nodes."""
from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from minidist import trace as _trace
from minidist.runtime.rank_process import to_cpu


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
        # Torn down before the interpreter's own teardown: left to that, gloo's threads were
        # sometimes destroyed while joinable and the rank aborted at exit ("terminate called
        # without an active exception"; 4 of 15 runs of tests/test_torchrun.py's job).
        atexit.register(_destroy)
    _trace.install()
    return dist.get_rank(), dist.get_world_size()


def _destroy():
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout):
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: they must match")
    init_from_env(backend, timeout)
    result = to_cpu(fn(*args, **kwargs))
    gathered = [None] * env_world
    dist.all_gather_object(gathered, result)
    return gathered
