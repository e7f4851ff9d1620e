"""Launch overhead: ``minidist.launch`` (fork and spawn paths) next to ``torch.multiprocessing.spawn``.

Each launch starts N ranks, joins a gloo process group, runs one all-reduce and exits;
the time is the wall-clock of the whole call, as a notebook user experiences it.
"""
from __future__ import annotations

import datetime
import os
import statistics
import tempfile


def add_arguments(parser):
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="launches per fast path (spawn paths run fewer)")


def _one_all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


def _torch_spawn_worker(rank, world_size, store_path):
    import torch.distributed as dist
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    _one_all_reduce()
    dist.destroy_process_group()


def _torch_spawn(world_size):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_torch_spawn_worker, args=(world_size, os.path.join(d, "store")), nprocs=world_size, join=True)


def _time(fn, repeats):
    import minidist
    times = []
    for _ in range(repeats):
        with minidist.timed() as t:
            fn()
        times.append(t.seconds)
    return times


def run(args) -> list[dict]:
    import minidist
    n = args.world_size
    fast = max(1, args.repeats)
    slow = max(1, min(3, args.repeats // 2))
    cases = [
        ("minidist.launch (fork)", lambda: minidist.launch(_one_all_reduce, n, start_method="fork"), fast),
        ("minidist.launch (spawn + cloudpickle)", lambda: minidist.launch(_one_all_reduce, n, start_method="spawn"), slow),
        ("torch.multiprocessing.spawn", lambda: _torch_spawn(n), slow),
    ]
    rows = []
    for name, fn, repeats in cases:
        times = _time(fn, repeats)
        rows.append({"launcher": name, "world_size": n, "runs": repeats,
                     "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)})
    base = rows[-1]["median_s"]
    for row in rows:
        row["speedup_vs_torch_spawn"] = base / row["median_s"]
    return rows
