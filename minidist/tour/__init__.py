"""``minidist tour``: every technique, run on 4 CPU ranks and checked against a reference.

One module per technique in this package offers ``tour_entries()``; listing it in
``TOUR_MODULES`` (with the lecture it belongs to) adds its rows.
A row says how far the distributed result is from the single-process reference, how
many bytes each rank sent next to what theory predicts, and how long it took; ``passed``
says whether ``max_err`` is within ``tolerance`` (and whatever else the technique's module
checked, when it sets ``passed`` itself), so scripts need not guess from ``note``.

The runner calls ``on_row`` as each row finishes, so the command prints a line per row
while the next one runs (:func:`row_line`), a heading per lecture and a closing summary.
"""
from __future__ import annotations

import importlib
import os
import textwrap
from dataclasses import dataclass
from typing import Callable

from minidist.checks.kit.launch import TOL

TOUR_MODULES = [
    "minidist.tour.collectives",     # torch's own all-reduce (baseline), then every variant of lecture 1
    "minidist.tour.data_parallel",   # naive DDP, bucketed DDP, parameter server, ZeRO-1/2/3
    "minidist.tour.pipeline",        # naive, GPipe, 1F1B, interleaved, ZB-H1: error, bytes, bubble
    "minidist.tour.tensor_parallel", # Megatron column/row, MLP, attention (GQA), vocab CE, block with and without SP
    "minidist.tour.context_parallel", # Ulysses (MHA, GQA, MQA), ring (MHA, GQA), causal ring contiguous vs zigzag
    "minidist.tour.parallel3d",      # DP 2 x PP 2 x TP 2 TinyGPT on 8 ranks: loss, weights, bytes per axis, memory
    "minidist.tour.memory_techniques",  # mixed precision under ZeRO, selective/full recomputation, offload
    "minidist.tour.expert_parallel", # MoE dispatch/combine, layer vs one process (drops, skew), DP 2 x EP 2 step
    "minidist.tour.checkpoint",      # reshard ZeRO-3 x 4 -> DDP x 2, async vs blocking save, restarts
    "minidist.tour.overlap",         # async TP rings, DDP buckets during backward, FSDP prefetch vs their plain versions
]

# The heading printed above each module's rows: the lecture (deck in slides/) it tours.
LECTURES = {
    "minidist.tour.collectives": "Lecture 1: collectives from send/recv",
    "minidist.tour.data_parallel": "Lectures 2-3: data parallelism, ZeRO and FSDP",
    "minidist.tour.pipeline": "Lecture 4: pipeline parallelism",
    "minidist.tour.tensor_parallel": "Lecture 5: tensor and sequence parallelism",
    "minidist.tour.context_parallel": "Lecture 6: context parallelism",
    "minidist.tour.parallel3d": "Lecture 7: 3D parallelism (DP x PP x TP)",
    "minidist.tour.memory_techniques": "Lecture 8: memory: mixed precision, recomputation, offload",
    "minidist.tour.expert_parallel": "Lecture 9: expert parallelism (Mixture of Experts)",
    "minidist.tour.checkpoint": "Lecture 10: distributed checkpoints, surviving failures",
    "minidist.tour.overlap": "Lecture 11: overlapping communication with computation",
}

COLUMNS = ["technique", "world_size", "passed", "max_err", "tolerance", "bytes_per_rank", "bytes_theory",
           "time_s", "note"]

WIDTH = 100          # no printed line is wider


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


def entries(only: str | None = None) -> list[tuple[str, TourEntry]]:
    """(module, entry) of every row the tour would run; ``only`` keeps names containing it."""
    out = []
    for name in TOUR_MODULES:
        for entry in importlib.import_module(name).tour_entries():
            if not only or only.lower() in entry.name.lower():
                out.append((name, entry))
    return out


def run_entry(entry: TourEntry) -> dict:
    """The entry's row, judged; a technique that raises is a failed row, not a crashed tour."""
    try:
        row = judge(entry.run(), entry.tolerance)
    except Exception as err:    # one broken technique must not hide the others
        row = {"technique": entry.name, "world_size": entry.world_size, "passed": False,
               "tolerance": entry.tolerance,
               "note": f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:120]}"}
    extra = {k: v for k, v in row.items() if k not in COLUMNS}
    return {c: row.get(c) for c in COLUMNS if c != "note"} | extra | {"note": row.get("note")}


def run_tour(only: str | None = None, on_row: Callable | None = None,
             selected: list[tuple[str, TourEntry]] | None = None) -> list[dict]:
    """Every row, in order. ``on_row(row, index, total, module)`` is called as each one finishes."""
    selected = entries(only) if selected is None else selected
    rows = []
    for i, (module, entry) in enumerate(selected):
        rows.append(run_entry(entry))
        if on_row:
            on_row(rows[-1], i, len(selected), module)
    return rows


# ---------------------------------------------------------------------------- printing
def use_colour(stream) -> bool:
    """Colour only for a person at a terminal who has not asked for none (https://no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def _size(n) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{0 if abs(n) >= 10 * scale else 1}f} {unit}"
    return f"{n:.0f} B"


def _number(x) -> str:
    if not isinstance(x, (int, float)) or x != x:
        return "-"
    return f"{x:.0e}" if float(f"{x:.0e}") == x else f"{x:.1e}"        # a tolerance 1e-05, an error 1.3e-06


ERROR, BYTES, TIME = 17, 21, 9      # columns; the technique's name gets what is left of WIDTH


def _prefix_width(total: int) -> int:
    return len(f"[{total}/{total}] ✓ ")


def header(total: int) -> str:
    """The column names, aligned with :func:`row_line`'s values."""
    name = WIDTH - _prefix_width(total) - ERROR - BYTES - TIME
    return (" " * _prefix_width(total) +
            f"{'technique':<{name}}{'error / tolerance':>{ERROR}}{'bytes/rank / theory':>{BYTES}}{'time':>{TIME}}")


def row_line(row: dict, index: int, total: int, colour: bool = False) -> str:
    """``[ 3/35] ✓ technique   error / tolerance   bytes / theory   time``, at most WIDTH columns
    (the mark's colour codes take no columns)."""
    mark = "✓" if row["passed"] else "✗"
    if colour:
        mark = f"\033[{32 if row['passed'] else 31}m{mark}\033[0m"
    width = WIDTH - _prefix_width(total) - ERROR - BYTES - TIME
    name = str(row["technique"])
    name = name if len(name) < width else name[:width - 2] + "…"
    error = f"{_number(row.get('max_err'))} / {_number(row.get('tolerance'))}"
    traffic = f"{_size(row.get('bytes_per_rank'))} / {_size(row.get('bytes_theory'))}"
    seconds = row.get("time_s")
    time = f"{seconds:.2f} s" if isinstance(seconds, (int, float)) else "-"
    return (f"[{index + 1:>{len(str(total))}}/{total}] {mark} "
            f"{name:<{width}}{error:>{ERROR}}{traffic:>{BYTES}}{time:>{TIME}}")


def detail_lines(row: dict, verbose: bool) -> list[str]:
    """The row's note under it: always for a failed row (why), for every row with ``verbose``."""
    note = row.get("note")
    if not note or not (verbose or not row["passed"]):
        return []
    return textwrap.wrap(str(note), WIDTH, initial_indent=" " * 10, subsequent_indent=" " * 10)


def summary_line(rows: list[dict], seconds: float) -> str:
    failed = [r["technique"] for r in rows if not r["passed"]]
    line = f"{len(rows) - len(failed)}/{len(rows)} passed in {seconds:.1f} s"
    return line + (f"; failed: {', '.join(failed)}" if failed else "")
