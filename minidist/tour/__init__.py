"""``minidist tour``: every technique, run on 4 CPU ranks and checked against a reference.

One module per technique in this package offers ``tour_entries()``; listing it in
``TOUR_MODULES`` adds its rows.
A row says how far the distributed result is from the single-process reference, how
many bytes each rank sent next to what theory predicts, and how long it took; ``passed``
says whether ``max_err`` is within ``tolerance`` (and whatever else the technique's module
checked, when it sets ``passed`` itself), so scripts need not guess from ``note``.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Callable

from minidist.checks.common import TOL

TOUR_MODULES = [
    "minidist.tour.collectives",     # torch's own all-reduce (baseline), then every variant of lecture 1
    "minidist.tour.data_parallel",   # naive DDP, bucketed DDP, parameter server, ZeRO-1/2/3
    "minidist.tour.pipeline",        # naive, GPipe, 1F1B, interleaved, ZB-H1: error, bytes, bubble
    "minidist.tour.tensor_parallel", # Megatron column/row, MLP, attention (GQA), vocab CE, block with and without SP
    "minidist.tour.context_parallel", # Ulysses (MHA, GQA, MQA), ring (MHA, GQA), causal ring contiguous vs zigzag
    "minidist.tour.parallel3d",      # DP 2 x PP 2 x TP 2 TinyGPT on 8 ranks: loss, weights, bytes per axis, memory
]

COLUMNS = ["technique", "world_size", "passed", "max_err", "tolerance", "bytes_per_rank", "bytes_theory",
           "time_s", "note"]


@dataclass
class TourEntry:
    name: str
    world_size: int
    run: Callable[[], dict]     # returns a row (see COLUMNS); raises if the technique is broken
    tolerance: float = TOL      # max_err allowed against the reference (fp32 equality, as the lab checks)


def judge(row: dict, tolerance: float) -> dict:
    """``row`` with ``tolerance`` (the row's own, else the entry's) and ``passed``: max_err
    is a number within it, and the module's own ``passed`` (if any) is true."""
    tolerance = row.get("tolerance", tolerance)
    err = row.get("max_err")
    within = isinstance(err, (int, float)) and err == err and err <= tolerance    # NaN is not within
    return row | {"tolerance": tolerance, "passed": bool(within and row.get("passed", True))}


def run_tour(only: str | None = None) -> list[dict]:
    rows = []
    for name in TOUR_MODULES:
        module = importlib.import_module(name)
        for entry in module.tour_entries():
            if only and only.lower() not in entry.name.lower():
                continue
            try:
                row = judge(entry.run(), entry.tolerance)
            except Exception as err:    # one broken technique must not hide the others
                row = {"technique": entry.name, "world_size": entry.world_size, "passed": False,
                       "tolerance": entry.tolerance,
                       "note": f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:120]}"}
            extra = {k: v for k, v in row.items() if k not in COLUMNS}
            rows.append({c: row.get(c) for c in COLUMNS if c != "note"} | extra | {"note": row.get("note")})
    return rows
