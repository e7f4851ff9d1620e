"""Measurement runs of pipeline schedules: one traced step on p fresh ranks, and the bytes a
stage holds between its backwards.

The Gantt charts of lecture 4 and lab 4 come from here: the executor's compute spans and
messages, recorded by the tracer, turned into the simulator's slots by
:mod:`minidist.pipeline.timeline`.
"""
from __future__ import annotations

import weakref

import torch.distributed as dist
import torch.nn as nn

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


class _Watched(nn.Module):
    """A stage that remembers (weakly) each micro-batch's input and output, and notes, when a
    backward reaches an output, how many earlier micro-batches whose backward already began
    still have their input or output alive."""

    def __init__(self, inner: nn.Module, ignore: set, samples: list):
        super().__init__()
        self.inner, self.ignore, self.samples, self.done = inner, ignore, samples, []

    def forward(self, x):
        out = self.inner(x)
        if out.requires_grad:
            ins = None if x.untyped_storage().data_ptr() in self.ignore else weakref.ref(x)
            refs = (ins, weakref.ref(out))
            out.register_hook(lambda grad: self._began(refs))
        return out

    def _began(self, refs):
        self.samples.append(sum(any(r is not None and r() is not None for r in old) for old in self.done))
        self.done.append(refs)


def kept_at_each_backward(run, chunks, ignore=()) -> tuple[object, list[int]]:
    """``run(wrapped_chunks)``: its result, and, each time a backward reaches a chunk's output (in
    the order they ran), how many micro-batches whose backward had already begun still had their
    chunk input or output alive. Between micro-batches an executor holds only those the schedule
    has in flight: a finished one that stays alive (its input, a received buffer, or its output kept
    in a dict) is memory the schedule does not account for. ``ignore``: tensors whose storage the
    caller owns (the batch, whose micro-batch views the executor may keep: no new memory)."""
    samples: list[int] = []
    storages = {t.untyped_storage().data_ptr() for t in ignore}
    result = run([_Watched(c, storages, samples) for c in chunks])
    return result, samples
