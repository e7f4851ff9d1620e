"""What a trace holds: one :class:`Event` per call, and the questions a :class:`Trace` answers.

Bytes are payload bytes as the caller sees them: ``send``/``isend`` count as sent,
``recv``/``irecv`` as received, a collective counts its input tensor(s) once: the list
form ``all_gather(outputs, x)`` counts ``x``, exactly as ``all_gather_into_tensor(out, x)``
does, never the N outputs it fills. For minidist's own algorithms, which are built from
send/recv, that is exactly the traffic on the wire, which is what the α-β model in
``minidist.cost`` predicts.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, asdict
from typing import Iterable

P2P_SEND = {"send", "isend"}
P2P_RECV = {"recv", "irecv"}
P2P_OPS = P2P_SEND | P2P_RECV
COLLECTIVES = {
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "batch_isend_irecv", "monitored_barrier",
    "reduce_scatter_single", "all_gather_single",      # torch >= 2.13 names of the *_tensor ops
}
PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


@dataclass
class Event:
    op: str                 # "send", "all_reduce", "span:F", "api:ring_all_reduce", ...
    rank: int               # global rank that issued it
    peer: int | None        # global rank of the other side (p2p only)
    group: tuple | None     # global ranks of the group, None for the default group
    nbytes: int             # payload bytes (see module docstring)
    start: float            # time.perf_counter() seconds (CLOCK_MONOTONIC: comparable across local processes)
    end: float
    tag: int = 0
    where: str = ""         # "file:line" of the caller
    meta: dict = field(default_factory=dict)    # "via": the native path used, when not torch.distributed's function

    @property
    def is_send(self) -> bool:
        return self.op in P2P_SEND

    @property
    def is_recv(self) -> bool:
        return self.op in P2P_RECV


class Trace:
    """The events of one rank (or, after :func:`merge`, of many)."""

    def __init__(self, events: Iterable[Event] = ()):
        self.events: list[Event] = list(events)

    def __repr__(self):
        return f"Trace({len(self.events)} events, ops={dict(self.op_counts())})"

    def comm(self) -> list[Event]:
        """Communication events only (no spans or api regions)."""
        return [e for e in self.events if not e.op.startswith(("span:", "api:"))]

    def select(self, rank: int | None = None, op: str | set | None = None) -> "Trace":
        ops = {op} if isinstance(op, str) else op
        return Trace(e for e in self.events if (rank is None or e.rank == rank) and (ops is None or e.op in ops))

    def bytes_sent(self, rank: int | None = None) -> int:
        return sum(e.nbytes for e in self.select(rank).events if e.is_send)

    def bytes_received(self, rank: int | None = None) -> int:
        return sum(e.nbytes for e in self.select(rank).events if e.is_recv)

    def peers_sent_to(self, rank: int | None = None) -> set[int]:
        return {e.peer for e in self.select(rank).events if e.is_send}

    def peers_received_from(self, rank: int | None = None) -> set[int]:
        return {e.peer for e in self.select(rank).events if e.is_recv}

    def op_counts(self, rank: int | None = None) -> Counter:
        return Counter(e.op for e in self.select(rank).events)

    def edges(self) -> Counter:
        """(src, dst) -> bytes, from the send side of every p2p message."""
        out: Counter = Counter()
        for e in self.events:
            if e.is_send:
                out[(e.rank, e.peer)] += e.nbytes
        return out

    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def to_chrome(self, path: str | None = None) -> dict:
        """Chrome trace JSON (opens in Perfetto / chrome://tracing): one row per rank."""
        t0 = min((e.start for e in self.events), default=0.0)
        rows = []
        for e in self.events:
            args = {"peer": e.peer, "bytes": e.nbytes, "where": e.where, **e.meta}
            rows.append({"name": e.op if e.peer is None else f"{e.op}({e.peer})", "ph": "X",
                         "pid": 0, "tid": e.rank, "ts": (e.start - t0) * 1e6,
                         "dur": max(e.end - e.start, 0.0) * 1e6,
                         "cat": e.op.split(":")[0], "args": args})
        doc = {"traceEvents": rows, "displayTimeUnit": "ms"}
        if path:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]


def merge(traces: Iterable[Trace | None]) -> Trace:
    """One trace from many ranks' traces (``None`` entries are skipped)."""
    return Trace(e for t in traces if t is not None for e in t.events)
