"""``minidist tour`` rows for data parallelism: naive and bucketed DDP, the parameter
server, ZeRO-1/2/3, each against single-process training, the lecture's traffic and the
ZeRO memory formula."""
from __future__ import annotations

from minidist.cost import theory_wire_bytes, zero_memory_bytes_fp32
from minidist.harness.data_parallel import ZERO_STAGE, reference_parameters, train_cases
from minidist.runtime import launch, timed
from minidist.tour import TourEntry

TOUR_LABELS = {"naive_ddp": "DDP, naive (all-reduce per gradient)",
               "bucketed_ddp": "DDP, bucketed with overlap",
               "parameter_server": "data parallel, parameter server",
               "zero1": "ZeRO-1 (sharded Adam states)",
               "zero2": "ZeRO-2 (+ sharded gradients)",
               "zero3": "ZeRO-3 / FSDP (+ sharded parameters)"}


def tour_row(variant: str, world_size: int = 4) -> dict:
    """One row: error vs reference, traffic vs theory, memory vs formula."""
    case = dict(variant=variant, model_kwargs={"hidden": 32, "tied": True}, batch=24, steps=3,
                bucket_cap_bytes=2048, measure=True, peak=True)
    with timed() as elapsed:
        out = launch(train_cases, world_size, [case], timeout=120)
    ref = reference_parameters(case["model_kwargs"], case["steps"], case["batch"])
    err = max((o[0]["params"] - ref).abs().max().item() for o in out)
    r0 = out[0][0]
    formula = zero_memory_bytes_fp32(ZERO_STAGE.get(variant, 0), r0["numel"], world_size)["total"]
    mem = r0["memory"]["total"]
    return {"technique": TOUR_LABELS[variant], "world_size": world_size, "max_err": err,
            "bytes_per_rank": max(o[0]["wire_bytes"] for o in out),
            "bytes_theory": theory_wire_bytes(variant, r0["numel"], world_size), "time_s": elapsed.seconds,
            "note": (f"ring model of traced payloads; rank-0 model states {mem} B vs formula "
                     f"{formula:.0f} B ({100 * (mem / formula - 1):+.1f}%)"),
            "memory_bytes": mem, "memory_formula": formula, "peak_step_bytes": r0["peak_step_bytes"]}


def tour_entries() -> list[TourEntry]:
    return [TourEntry(v, 4, lambda v=v: tour_row(v)) for v in TOUR_LABELS]
