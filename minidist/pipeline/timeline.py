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

A measured bubble also depends on how busy the machine is. :func:`replayed_slots` takes
only what load cannot change from a traced run: each rank's *order* of computes, sends
and receive-waits (program order on one thread), and replays it with compute taking
exactly ``costs`` and messages free. An executor that runs its schedule faithfully
replays to the simulator's bubble exactly; one that waits for messages before it needs
them, or computes out of order, replays to a larger one, on a quiet or a loaded machine.
"""
from __future__ import annotations

import json

from collections import defaultdict

from minidist.pipeline.schedules import COMPUTE
from minidist.pipeline.simulator import Costs, Slot, bubble_fraction


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


def replayed_slots(trace, costs: Costs, ranks: list[int] | None = None) -> list[Slot]:
    """The timeline of a traced run replayed at fixed costs (see the module doc).

    Per rank, in program order (the rank's own clock orders its events): a compute span
    (at its start) takes ``costs.of(kind)``; a send (at its post) makes its message
    available at the sender's replay clock; a receive (where its wait returned) waits
    for the matching message, the k-th one on its (source, destination) channel; the k-th
    collective (a barrier, say) of every rank ends when the last rank reaches its k-th.
    Raises ``ValueError`` if the order cannot be replayed (a receive with no send).
    """
    order = {g: i for i, g in enumerate(ranks)} if ranks else None
    rank_of = (lambda g: order[g]) if order else (lambda g: g)     # noqa: E731
    programs = defaultdict(list)
    for e in trace.events:
        me = rank_of(e.rank)
        if e.op.startswith("span:") and e.op[5:] in COMPUTE:
            programs[me].append((e.start, 0, ("compute", e.op[5:], e.meta.get("mb", 0), e.meta.get("chunk", 0))))
        elif e.is_send:
            programs[me].append((e.start, 1, ("send", rank_of(e.peer))))
        elif e.is_recv:
            programs[me].append((e.end, 2, ("recv", rank_of(e.peer))))
        elif e.is_comm:
            programs[me].append((e.end, 2, ("collective",)))
    programs = {r: [item for *_, item in sorted(prog, key=lambda x: (x[0], x[1]))] for r, prog in programs.items()}
    clock, pc = defaultdict(float), defaultdict(int)
    posted, taken = defaultdict(list), defaultdict(int)          # (src, dst) -> post times; receives done
    arrived, done = defaultdict(dict), defaultdict(int)          # k -> {rank: clock}; collectives passed
    slots = []
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pc[r] < len(prog):
                item = prog[pc[r]]
                if item[0] == "compute":
                    _, kind, mb, chunk = item
                    slots.append(Slot(r, kind, mb, chunk, clock[r], clock[r] + costs.of(kind)))
                    clock[r] += costs.of(kind)
                elif item[0] == "send":
                    posted[(r, item[1])].append(clock[r])
                elif item[0] == "collective":
                    k = done[r]
                    arrived[k][r] = clock[r]
                    if len(arrived[k]) < len(programs):
                        break                                   # the others have not reached it yet
                    clock[r] = max(arrived[k].values())
                    done[r] += 1
                else:
                    channel = (item[1], r)
                    if taken[channel] >= len(posted[channel]):
                        break                                   # its send is not replayed yet
                    clock[r] = max(clock[r], posted[channel][taken[channel]])
                    taken[channel] += 1
                pc[r] += 1
                progress = True
    stuck = [r for r, prog in programs.items() if pc[r] < len(prog)]
    if stuck:
        raise ValueError(f"cannot replay the trace: ranks {stuck} wait for messages nobody sent")
    return sorted(slots, key=lambda s: (s.rank, s.start))


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
