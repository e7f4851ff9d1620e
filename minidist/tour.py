"""``minidist tour``: every technique, run on 4 CPU ranks and checked against a reference.

Each technique module offers ``tour_entries()``; listing the module here adds its rows.
A row says how far the distributed result is from the single-process reference, how
many bytes each rank sent next to what theory predicts, and how long it took.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import minidist
from minidist.trace import trace

TOUR_MODULES = [
    "minidist.tour",            # the baseline below: torch's own all-reduce through the launcher and tracer
    "minidist.allreduce",       # every all-reduce variant of lecture 1, built from send/recv
    "minidist.data_parallel",   # naive DDP, bucketed DDP, parameter server
    "minidist.zero",            # ZeRO-1, ZeRO-2, ZeRO-3 / FSDP
    "minidist.pipeline.tour",   # naive, GPipe, 1F1B, interleaved, ZB-H1: error, bytes, bubble
]

COLUMNS = ["technique", "world_size", "max_err", "bytes_per_rank", "bytes_theory", "time_s", "note"]


@dataclass
class TourEntry:
    name: str
    world_size: int
    run: Callable[[], dict]     # returns a row (see COLUMNS); raises if the technique is broken


def _native_all_reduce(numel):
    torch.manual_seed(dist.get_rank())
    x = torch.randn(numel)
    with trace() as t:
        y = x.clone()
        dist.all_reduce(y)
    return x, y, sum(e.nbytes for e in t.comm())


def _run_native(world_size=4, numel=1 << 16):
    start = time.perf_counter()
    out = minidist.launch(_native_all_reduce, world_size, numel)
    elapsed = time.perf_counter() - start
    reference = sum(x for x, _, _ in out)
    err = max((y - reference).abs().max().item() for _, y, _ in out)
    return {"technique": "all_reduce (torch native, baseline)", "world_size": world_size, "max_err": err,
            "bytes_per_rank": max(b for _, _, b in out), "bytes_theory": numel * 4, "time_s": elapsed,
            "note": "payload bytes handed to gloo; its algorithm is not traced"}


def tour_entries() -> list[TourEntry]:
    return [TourEntry("all_reduce (torch native)", 4, _run_native)]


def run_tour(only: str | None = None) -> list[dict]:
    rows = []
    for name in TOUR_MODULES:
        module = importlib.import_module(name)
        for entry in module.tour_entries():
            if only and only.lower() not in entry.name.lower():
                continue
            try:
                row = entry.run()
            except Exception as err:    # one broken technique must not hide the others
                row = {"technique": entry.name, "world_size": entry.world_size,
                       "note": f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:120]}"}
            extra = {k: v for k, v in row.items() if k not in COLUMNS}
            rows.append({c: row.get(c) for c in COLUMNS if c != "note"} | extra | {"note": row.get("note")})
    return rows
