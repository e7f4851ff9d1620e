"""Lab 11's answers: what the student's function did on this rank (rank ``on.r`` of a group of
``on.t``), as plain data. The only file of lab 11's checks that calls student code.

A distributed answer runs the function once under the tracer and records its output, every
communication the trace saw (op, peer, bytes and its four times: start, issued, waited, end) and the
computation it did through the callable the check hands it (``layer`` or ``mm``): which unit or chunk
each call computed, and when it started and ended. Times are seconds from the call's start, on the
clock the tracer uses (``time.perf_counter``), so the verdict can put them in order.
"""
from __future__ import annotations

import time

import torch

from minidist.checks.kit.compare import on_rank
from minidist.checks.lab11_overlap.cases import ag_shards, ag_weight, prefetch_input, rs_inputs, unit_weights, \
    weight_shard
from minidist.trace import compute, trace


def _which(a: torch.Tensor, chunks: list[torch.Tensor]) -> int:
    """The index of the chunk ``a`` holds (-1: none of them; a tensor without data, the device check's)."""
    try:
        got = a.detach().to("cpu")
    except Exception:        # noqa: BLE001  meta: nothing to compare
        return -1
    return next((i for i, c in enumerate(chunks) if got.shape == c.shape and torch.equal(got, c.to(got.dtype))), -1)


def _run(call, computed: list) -> dict:
    """``call()`` under the tracer: its output, its communication and ``computed``, times from its start."""
    t0 = time.perf_counter()
    with trace() as tr:
        out = call()
    rel = lambda v: None if v is None else v - t0        # noqa: E731
    events = [[e.op, e.peer, e.nbytes, rel(e.start), rel(e.issued), rel(e.waited), rel(e.end)] for e in tr.comm()]
    return {"out": out, "comm": events, "computed": [[c, a - t0, b - t0] for c, a, b in computed]}


def _recorded(name: str, computed: list, index, fn):
    """A callable handed to the student: ``fn`` timed into ``computed`` as (index(args), start, end), and
    shown on a timeline as ``compute:NAME``."""
    def call(*args):
        start = time.perf_counter()
        with compute(name):
            out = fn(*args)
        computed.append((index(*args), start, time.perf_counter()))
        return out
    return call


def prefetch(name, fn, case, on) -> dict:
    """``prefetch_forward(x, shards, layer, group)``: this rank's shard of every unit's weight; ``layer(i, x, w)``
    records which unit it ran."""
    shards = [on_rank(weight_shard(w, on.r, on.t)) for w in unit_weights(case)]
    computed: list = []
    layer = _recorded("layer", computed, lambda i, x, w: int(i), lambda i, x, w: torch.tanh(x @ w.T))
    return _run(lambda: fn(on_rank(prefetch_input(case)), shards, layer, on.group), computed)


def ag_matmul(name, fn, case, on) -> dict:
    """``all_gather_matmul(x_shard, weight, mm, group)``: ``mm(x_c, w)`` records whose chunk it multiplied."""
    shards = ag_shards(case, on.t)
    computed: list = []
    mm = _recorded("matmul", computed, lambda a, w: _which(a, shards), lambda a, w: a @ w.T)
    return _run(lambda: fn(on_rank(shards[on.r]), on_rank(ag_weight(case)), mm, on.group), computed)


def rs_matmul(name, fn, case, on) -> dict:
    """``matmul_reduce_scatter(x, weight, mm, group)``: ``mm(x_c, w)`` records which of this rank's sequence
    chunks it multiplied."""
    x, w = rs_inputs(case, on.t)[on.r]
    chunks = list(x.tensor_split(on.t, 0))
    computed: list = []
    mm = _recorded("matmul", computed, lambda a, w_: _which(a, chunks), lambda a, w_: a @ w_.T)
    return _run(lambda: fn(on_rank(x), on_rank(w), mm, on.group), computed)


def exposed(fn, case) -> object:
    """``exposed_time(events, rank)`` on a copy of the case's events (in this process)."""
    return fn([dict(e, meta=dict(e["meta"])) for e in case["events"]], case["rank"])


#: per distributed function: answer(name, fn, case, on)
ANSWER = {"prefetch_forward": prefetch, "all_gather_matmul": ag_matmul, "matmul_reduce_scatter": rs_matmul}
