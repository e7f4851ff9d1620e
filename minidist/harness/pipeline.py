"""Measurement runs of pipeline schedules: one traced step on p fresh ranks.

The Gantt charts of lecture 4 and lab 4 come from here: the executor's compute spans and
messages, recorded by the tracer, turned into the simulator's slots by
:mod:`minidist.pipeline.timeline`.
"""
from __future__ import annotations

import torch.distributed as dist

from minidist.models import block_stack, regression_batch
from minidist.pipeline import partition, rank_chunks, run_schedule, slots_from_trace
from minidist.runtime import launch
from minidist.trace import merge, trace


def _traced_rank(schedule, costs, width, batch):
    s, rank = schedule, dist.get_rank()
    chunks = rank_chunks(partition(block_stack(s.num_stages, width), s.num_stages), s.p, rank)
    x, y = regression_batch(batch, width)
    run_schedule(s, chunks, x, y)                # warm-up step: first calls are slow
    dist.barrier()
    with trace() as t:
        run_schedule(s, chunks, x, y, costs=costs)
    return t


def measure(schedule, costs=None, width: int = 8, batch: int | None = None, timeout: float = 120):
    """Run one step of ``schedule`` on p fresh ranks, traced; returns (slots, merged trace).

    The model is a residual-MLP stack with one block per stage. With ``costs`` (e.g.
    ``Costs(F=0.05, B=0.1)``) every action sleeps to that wall time (sleep-compute
    mode). ``trace.to_chrome(path)`` then writes the run, messages included, for Perfetto.
    """
    batch = batch or 4 * schedule.m
    traces = launch(_traced_rank, schedule.p, schedule, costs, width, batch, timeout=timeout)
    merged = merge(traces)
    return slots_from_trace(merged), merged
