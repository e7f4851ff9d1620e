"""minidist.trace.timeline: a trace as Chrome/Perfetto trace-event JSON (schema-checked, one track
per rank), and exposed communication (the time a rank waited on it), exactly on hand-made events
and as recorded by real ranks."""
import json
import time

import jsonschema
import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.plots import plot_timeline
from minidist.trace import Event, Trace, compute, merge, span, trace
from minidist.trace.timeline import (blocked, chrome_trace, exposed, exposed_report, in_flight, union,
                                     write_chrome_trace)

# The trace-event format (the one torch.profiler writes): complete events and metadata.
SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {"traceEvents": {"type": "array", "items": {"oneOf": [
        {"type": "object", "required": ["ph", "name", "cat", "pid", "tid", "ts", "dur"],
         "properties": {"ph": {"const": "X"}, "name": {"type": "string"}, "cat": {"type": "string"},
                        "pid": {"type": "integer", "minimum": 0}, "tid": {"type": "integer", "minimum": 0},
                        "ts": {"type": "number", "minimum": 0}, "dur": {"type": "number", "minimum": 0},
                        "args": {"type": "object"}}},
        {"type": "object", "required": ["ph", "name", "pid", "tid", "args"],
         "properties": {"ph": {"const": "M"},
                        "name": {"enum": ["process_name", "process_sort_index", "thread_name", "thread_sort_index"]},
                        "pid": {"type": "integer"}, "tid": {"type": "integer"}, "args": {"type": "object"}}},
    ]}}, "displayTimeUnit": {"enum": ["ms", "ns"]}},
}


def _ev(op, rank, start, end, issued=None, waited=None):
    return Event(op, rank, None, None, 8, start, end, issued=issued, waited=waited)


def test_waits_and_exposed_time_on_hand_made_events():
    t = Trace([
        _ev("compute:matmul", 0, 0.0, 4.0),
        _ev("all_reduce", 0, 1.0, 6.0, issued=1.5, waited=4.0),     # async: blocked 1-1.5 and 4-6
        _ev("all_gather_into_tensor", 0, 5.0, 7.0),                  # blocking, overlaps the wait above
        _ev("span:step", 0, 0.0, 8.0),
        _ev("all_reduce", 1, 2.0, 3.0, issued=2.1),                   # never waited for: only its issue
    ])
    assert blocked(t, 0) == [(1.0, 1.5), (4.0, 7.0)]
    assert exposed(t, 0) == pytest.approx(3.5)
    assert exposed(t, 0, between=(4.5, 10.0)) == pytest.approx(2.5)
    assert in_flight(t, 0) == pytest.approx(6.0)                      # 1..7
    assert exposed(t, 1) == pytest.approx(0.1)
    rows = {(r["rank"], r["step"]): r for r in exposed_report(t)}
    assert rows[0, 0]["exposed_s"] == pytest.approx(3.5) and rows[0, 0]["hidden_s"] == pytest.approx(2.5)
    assert rows[0, 0]["step_s"] == 8.0 and rows[1, None]["exposed_s"] == pytest.approx(0.1)
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]


def test_overlapping_events_get_lanes_of_their_own_and_nested_ones_share():
    t = Trace([_ev("span:step", 0, 0.0, 10.0), _ev("compute:a", 0, 1.0, 2.0),
               _ev("all_reduce", 0, 1.0, 5.0, issued=1.1, waited=4.0),
               _ev("all_reduce", 0, 2.0, 6.0, issued=2.1, waited=5.0)])     # overlaps the first, not nested
    doc = chrome_trace(t)
    jsonschema.validate(doc, SCHEMA)
    spans = [r for r in doc["traceEvents"] if r["ph"] == "X"]
    compute_tids = {r["tid"] for r in spans if r["cat"] in ("span", "compute")}
    comm_tids = [r["tid"] for r in spans if r["cat"] == "comm"]
    assert len(compute_tids) == 1 and len(set(comm_tids)) == 2
    waits = sorted((r["ts"], r["dur"]) for r in spans if r["cat"] == "wait" and r["dur"] > 0.2e6)
    assert waits == [(4e6, 1e6), (5e6, 1e6)]


def _recorded_step():
    """Rank 1 arrives 0.3 s late at a blocking all-reduce (rank 0 waits for it), then an async
    all-reduce runs while rank 0 computes 0.4 s (its wait is short), each in a span("step")."""
    rank = dist.get_rank()
    x = torch.ones(1 << 12)
    with trace() as t:
        with span("step"):
            with compute("late partner"):
                time.sleep(0.3 if rank == 1 else 0.0)
            dist.all_reduce(x)
        dist.barrier()
        with span("step"):
            work = dist.all_reduce(x, async_op=True)
            with compute("busy"):
                time.sleep(0.4 if rank == 0 else 0.05)
            work.wait()
        p2p = dist.isend(x, 1 - rank) if rank < 2 else None
        q = dist.irecv(torch.empty_like(x), 1 - rank) if rank < 2 else None
        for w in (p2p, q):
            if w is not None:
                w.wait()
    return t


@pytest.mark.parametrize("n", [2, 4])
def test_recorded_trace_exports_valid_trace_event_json_one_track_per_rank(n, tmp_path):
    t = merge(minidist.launch(_recorded_step, n, timeout=60))
    async_ops = [e for e in t.comm() if e.issued is not None]
    assert async_ops and all(e.start <= e.issued <= e.waited <= e.end for e in async_ops)
    assert all(e.issued is None and e.waited is None for e in t.comm() if e.op == "all_reduce"
               and e not in async_ops)
    path = tmp_path / "run.json"
    write_chrome_trace(t, str(path))
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, SCHEMA)
    names = {r["pid"]: r["args"]["name"] for r in doc["traceEvents"] if r["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(n)}
    assert {r["pid"] for r in doc["traceEvents"]} == set(range(n))
    cats = {r["cat"] for r in doc["traceEvents"] if r["ph"] == "X"}
    assert {"compute", "span", "comm", "wait"} <= cats
    assert t.to_chrome() == chrome_trace(t)
    rows = {(r["rank"], r["step"]): r for r in exposed_report(t)}
    # step 0: rank 0 waited for the late rank 1 in a blocking call; step 1: the async one hid behind 0.4 s
    assert rows[0, 0]["exposed_s"] >= 0.2 and rows[1, 0]["exposed_s"] < rows[0, 0]["exposed_s"]
    assert rows[0, 1]["exposed_s"] < 0.15 < rows[0, 1]["in_flight_s"]
    ax = plot_timeline(t)
    assert len(ax.patches) >= 3 * n


def test_tracing_off_records_nothing_and_compute_costs_one_check():
    with compute("x"):
        pass
    with trace() as t:
        with compute("y", chunk=2):
            pass
    assert [(e.op, e.meta) for e in t.events] == [("compute:y", {"chunk": 2})]
    assert t.comm() == []
