"""Timelines: the same Gantt data from the simulator and from a real traced run.

The executor wraps every compute action in ``minidist.trace.span(kind, mb=, chunk=)``,
so a ``trace()`` around a step records when each rank computed what. Both sources
become a list of :class:`~minidist.pipeline.simulator.Slot`, so one plot function
(:func:`minidist.plots.plot_pipeline_gantt`) draws either, and one bubble formula
measures either:

    bubble = 1 - sum(busy time of every rank) / (p * makespan)

where the makespan runs from the first compute start to the last compute end on any
rank. Idle time inside the step counts as bubble, whatever its cause: waiting on a
neighbour (the pipeline bubble proper) or on the network.
"""
from __future__ import annotations

import json

from minidist.pipeline.schedules import COMPUTE
from minidist.pipeline.simulator import Slot, bubble_fraction


def slots_from_trace(trace, ranks: list[int] | None = None) -> list[Slot]:
    """Compute slots from a (merged) trace, times in seconds from the first slot.

    ``ranks``: the global ranks of the pipeline group in group order, to renumber them
    as pipeline ranks 0..p-1 (default: global ranks as they are).
    """
    events = [e for e in trace.events if e.op.startswith("span:") and e.op[5:] in COMPUTE]
    if not events:
        return []
    t0 = min(e.start for e in events)
    order = {g: i for i, g in enumerate(ranks)} if ranks else None
    return sorted((Slot(order[e.rank] if order else e.rank, e.op[5:], e.meta.get("mb", 0),
                        e.meta.get("chunk", 0), e.start - t0, e.end - t0) for e in events),
                  key=lambda s: (s.rank, s.start))


def bubble_of(slots: list[Slot], p: int | None = None) -> float:
    """Bubble fraction of a timeline (simulated or measured)."""
    if not slots:
        return 0.0
    p = p or (max(s.rank for s in slots) + 1)
    busy = [0.0] * p
    for s in slots:
        busy[s.rank] += s.end - s.start
    start, end = min(s.start for s in slots), max(s.end for s in slots)
    return bubble_fraction(busy, end - start)


def to_chrome(slots: list[Slot], path: str | None = None, unit: float = 1e6) -> dict:
    """Chrome trace / Perfetto JSON of a timeline, one row per rank. ``unit``: microseconds
    per slot time unit (1e6 for seconds; for simulated unit costs any scale works).
    For a real run, ``Trace.to_chrome`` also shows the communication events."""
    rows = [{"name": f"{s.kind}{s.mb}" + (f"c{s.chunk}" if s.chunk else ""), "ph": "X", "pid": 0,
             "tid": s.rank, "ts": s.start * unit, "dur": (s.end - s.start) * unit, "cat": s.kind,
             "args": {"mb": s.mb, "chunk": s.chunk}} for s in slots]
    doc = {"traceEvents": rows, "displayTimeUnit": "ms"}
    if path:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc
