"""A trace as a timeline: Chrome/Perfetto trace-event JSON, and the communication it exposed.

What a rank did, from its :class:`~minidist.trace.events.Trace`, as three kinds of span:

* **compute**: ``compute()`` regions (a chunk's matmul, a unit's forward) and ``span()`` phases
  (a backward pass, a pipeline action, a step);
* **communication**: each operation from the moment it was issued to the moment it completed
  (a blocking call's return, or an asynchronous one's ``wait()``), ``api()`` regions around it;
* **wait**: the host blocked on communication: a blocking call from start to end; an
  asynchronous one while it was being issued and from its ``wait()`` to its completion.

**Exposed communication** is the time covered by a rank's waits (their union): time in which
the rank could not compute because it waited for bytes no computation had hidden. Communication
in flight while the rank computed is *hidden*: ``hidden = in flight - exposed``. Both are host
times, which is what a CPU rank (and a GPU rank's host, when it synchronises) sees.

:func:`chrome_trace` writes the trace-event format that ``torch.profiler`` writes (``ph: "X"``
complete events with ``ts``/``dur`` in µs, ``ph: "M"`` metadata naming processes and threads):
one process track per rank (``pid`` = rank), a thread per lane of each kind, so it opens in
https://ui.perfetto.dev or ``chrome://tracing``. Events on one thread must nest, so
overlapping ones (several buckets in flight) get lanes of their own.
"""
from __future__ import annotations

import json

# Types named in annotations only: minidist.trace.events.Event and Trace (whose to_chrome calls this
# module, so importing them here would make a cycle).

# lane kind -> (first thread id, thread name); ids far apart keep kinds apart however many lanes
KINDS = {"compute": (0, "compute"), "comm": (100, "communication"), "wait": (200, "waiting on communication")}


# ----------------------------------------------------------------------------- spans
def waits(e: Event) -> list[tuple[float, float]]:
    """The intervals in which the host was blocked on communication event ``e``."""
    if not e.is_comm:
        return []
    if e.issued is None:                       # a blocking call
        return [(e.start, e.end)]
    out = [(e.start, e.issued)]                # issuing it (long only when the call itself blocks)
    if e.waited is not None:
        out.append((e.waited, e.end))
    return [(a, b) for a, b in out if b > a]


def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly what ``intervals`` cover."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _measure(intervals, between=None) -> float:
    lo, hi = between if between is not None else (float("-inf"), float("inf"))
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in union(intervals))


def blocked(trace: Trace, rank: int) -> list[tuple[float, float]]:
    """When ``rank`` waited on communication: the union of its events' :func:`waits`."""
    return union(w for e in trace.events if e.rank == rank for w in waits(e))


def exposed(trace: Trace, rank: int, between: tuple[float, float] | None = None) -> float:
    """Seconds ``rank`` waited on communication (optionally only within ``between`` = (start, end))."""
    return _measure([w for e in trace.events if e.rank == rank for w in waits(e)], between)


def in_flight(trace: Trace, rank: int, between: tuple[float, float] | None = None) -> float:
    """Seconds in which some communication of ``rank`` was under way (issued, not yet completed)."""
    return _measure([(e.start, e.end) for e in trace.events if e.rank == rank and e.is_comm], between)


def steps(trace: Trace, rank: int, step: str = "step") -> list[Event]:
    """``rank``'s ``span(step)`` regions, in time order (what "per step" means below)."""
    return sorted((e for e in trace.events if e.rank == rank and e.op == f"span:{step}"), key=lambda e: e.start)


def exposed_report(trace: Trace, step: str | None = "step") -> list[dict]:
    """One row per rank and step (per rank only, when ``step`` is None or the rank has no such
    span): seconds of the step, of communication in flight, exposed (waited on) and hidden."""
    rows = []
    for rank in trace.ranks():
        regions = steps(trace, rank, step) if step else []
        windows = [(i, (e.start, e.end)) for i, e in enumerate(regions)] or [(None, None)]
        for i, window in windows:
            flight, waited = in_flight(trace, rank, window), exposed(trace, rank, window)
            row = {"rank": rank, "step": i, "in_flight_s": flight, "exposed_s": waited,
                   "hidden_s": max(0.0, flight - waited)}
            if window is not None:
                row["step_s"] = window[1] - window[0]
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- Chrome / Perfetto
def _kind(e: Event) -> str:
    return "compute" if e.op.startswith(("compute:", "span:")) else "comm"


def _name(e: Event) -> str:
    name = e.op.split(":", 1)[1] if e.op.startswith(("compute:", "span:")) else e.op
    return name if e.peer is None else f"{name}({e.peer})"


def _lanes(spans: list[tuple[float, float, object]]) -> list[tuple[int, tuple]]:
    """(lane, span) per span, in start order: a span joins the first lane where it nests (ends before what is
    open there ends, or starts after it ended), else a new lane."""
    open_: list[list[float]] = []              # per lane: the ends of its open spans, innermost last
    out = []
    for span in sorted(spans, key=lambda s: (s[0], -s[1])):
        start, end = span[0], span[1]
        for lane, stack in enumerate(open_):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                out.append((lane, span))
                break
        else:
            open_.append([end])
            out.append((len(open_) - 1, span))
    return out


def chrome_trace(trace: Trace) -> dict:
    """The trace as a trace-event document: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``,
    times in µs from the earliest event of any rank (ranks on one machine share the clock)."""
    t0 = min((e.start for e in trace.events), default=0.0)
    us = lambda t: round((t - t0) * 1e6, 3)        # noqa: E731
    rows: list[dict] = []
    for rank in trace.ranks():
        mine = [e for e in trace.events if e.rank == rank]
        rows += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                 {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
        spans = {"compute": [], "comm": [], "wait": []}
        for e in mine:
            spans[_kind(e)].append((e.start, e.end, e))
            spans["wait"] += [(a, b, e) for a, b in waits(e)]
        for kind, items in spans.items():
            first, title = KINDS[kind]
            placed = _lanes(items)
            for lane in sorted({lane for lane, _ in placed}):
                rows += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": first + lane,
                          "args": {"name": title if lane == 0 else f"{title} {lane + 1}"}},
                         {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": first + lane,
                          "args": {"sort_index": first + lane}}]
            for lane, (start, end, e) in placed:
                args = {"bytes": e.nbytes, "peer": e.peer, "group": list(e.group) if e.group else None,
                        "where": e.where, **e.meta}
                rows.append({"ph": "X", "name": ("wait " if kind == "wait" else "") + _name(e),
                             "cat": kind if kind != "compute" else e.op.split(":", 1)[0],
                             "pid": rank, "tid": first + lane, "ts": us(start), "dur": round((end - start) * 1e6, 3),
                             "args": {k: v for k, v in args.items() if v not in (None, "", 0) or k == "bytes"}})
    return {"traceEvents": rows, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: Trace, path: str) -> dict:
    """Write :func:`chrome_trace` to ``path`` (open it in Perfetto or chrome://tracing); return it."""
    doc = chrome_trace(trace)
    with open(path, "w") as f:
        json.dump(doc, f, default=str)
    return doc
