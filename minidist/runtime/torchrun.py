"""Under torchrun: the same ``launch(fn, N)`` call, one rank per process, across nodes.

torchrun starts the processes and describes them in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*). The device model is the launcher's: on a node with one
visible GPU per local rank, ``LOCAL_RANK`` picks this process's GPU and the group is the
device-mapped ``"cpu:gloo,cuda:nccl"``; otherwise the ranks are CPU ranks on gloo.
"""
from __future__ import annotations

import atexit
import datetime
import os

import torch.distributed as dist

from minidist import trace as _trace
from minidist.runtime.device import backend_for, prepare_nccl_environment, rank_device, resolve_device, set_rank_device
from minidist.runtime.rank_process import to_cpu

_BACKEND_KIND = {None: None, "gloo": "cpu", "nccl": "cuda"}


def init_from_env(backend: str | None = None, timeout: float = 600.0, device: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes; ``device``/``backend`` as in ``launch``."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env() needs {', '.join(missing)} in the environment: run under torchrun")
    if backend not in _BACKEND_KIND:
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    implied = _BACKEND_KIND[backend]
    if implied is not None and device is not None and device != implied:
        raise ValueError(f"backend={backend!r} means {implied} ranks, but device={device!r} was asked for")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # GPUs are counted per node: this node must have one for each of its local ranks.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    kind = resolve_device(device or implied, local_world)      # checked on every call, before any collective
    if not dist.is_initialized():
        dev = rank_device(kind, local_rank)
        set_rank_device(dev)
        if kind == "cuda":
            prepare_nccl_environment()      # the flight recorder dumps where torch's default says
        dist.init_process_group(backend_for(kind), timeout=datetime.timedelta(seconds=timeout),
                                **_attempt_store(timeout), **({"device_id": dev} if kind == "cuda" else {}))
        # Torn down before the interpreter's own teardown: left to that, gloo's threads were
        # sometimes destroyed while joinable and the rank aborted at exit ("terminate called
        # without an active exception"; 4 of 15 runs of tests/test_torchrun.py's job).
        atexit.register(_destroy)
    _trace.install()
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout: float) -> dict:
    """The agent's store, under a prefix of this restart attempt, where the elastic agent shares it.

    torchrun's agent (torch 2.13) keeps one TCPStore for every round of its rendezvous and lets
    the workers use it as it is: after a restart, a rank could read the gloo address its peer
    wrote in the previous attempt and fail with "connectFullMesh ... Connection refused" (2 of 5
    runs of tests/test_torchrun.py's elastic job). A prefix per attempt keeps each attempt's keys
    apart. Elsewhere: {} (init_process_group reads the environment itself)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"minidist/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _destroy():
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_under_torchrun(fn, world_size, args, kwargs, device, backend, timeout):
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: they must match")
    init_from_env(backend, timeout, device)
    result = to_cpu(fn(*args, **kwargs))
    gathered = [None] * env_world
    dist.all_gather_object(gathered, result)
    return gathered
