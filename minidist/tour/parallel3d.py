"""``minidist tour`` row for 3D parallelism: one DP 2 × PP 2 × TP 2 TinyGPT run on 8 ranks.

Three fp32 steps (1F1B, SGD with momentum) on torch's device mesh via
:mod:`minidist.harness.parallel3d`: max_err is the worse of the per-step loss and the
final-weight error against one process; bytes are the traced payloads of the busiest
rank's step summed over the three axes, next to :mod:`minidist.cost.parallel3d`; the row
passes only if every rank's traffic equals the model per axis in (op, bytes), its model
states equal the model's bytes and its saved activations are within 5%.
"""
from __future__ import annotations

from minidist.harness.parallel3d import TINY, Layout, run_layouts
from minidist.runtime import timed
from minidist.tour import TourEntry

LAYOUT = Layout(2, 2, 2, "1f1b", 2)


def _run() -> dict:
    with timed() as clock:
        (row,) = run_layouts([LAYOUT], TINY, steps=3, batch=8, optimizer="sgd", lr=0.1)
    by_axis = row["bytes_by_axis"]
    note = ", ".join(f"{a.upper()} {m} B" for a, (m, _) in by_axis.items())
    return {"technique": f"3D DP2 x PP2 x TP2 ({LAYOUT.schedule}, m={LAYOUT.micro_batches})", "world_size": 8,
            "max_err": max(row["loss_err"], row["weight_err"]),
            "bytes_per_rank": sum(m for m, _ in by_axis.values()), "bytes_theory": sum(p for _, p in by_axis.values()),
            "time_s": clock.seconds,
            "passed": row["traffic_equal"] and row["model_states_equal"] and row["activation_rel_err"] <= 0.05,
            "note": f"{note}; activations within {row['activation_rel_err']:.1%} of the model"}


def tour_entries():
    return [TourEntry("3D parallelism DP x PP x TP", 8, _run)]
