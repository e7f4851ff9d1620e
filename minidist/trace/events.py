"""What a trace holds: one :class:`Event` per call, and the questions a :class:`Trace` answers.

Bytes are payload bytes as the caller sees them: ``send``/``isend`` count as sent,
``recv``/``irecv`` as received, a collective counts its input tensor(s) once: the list
form ``all_gather(outputs, x)`` counts ``x``, exactly as ``all_gather_into_tensor(out, x)``
does, never the N outputs it fills. For minidist's own algorithms, which are built from
send/recv, that is exactly the traffic on the wire, which is what the α-β model in
``minidist.cost`` predicts.
"""
from __future__ import annotations

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
# Events that are regions of this rank's own work, not communication: ``span()`` (a named phase),
# ``api()`` (one of minidist's own algorithms, around the messages it sends), ``compute()``.
REGIONS = ("span:", "api:", "compute:")


@dataclass
class Event:
    op: str                 # "send", "all_reduce", "span:F", "api:ring_all_reduce", ...
    rank: int               # global rank that issued it
    peer: int | None        # global rank of the other side (p2p only)
    group: tuple | None     # global ranks of the group, None for the default group
    nbytes: int             # payload bytes (see module docstring)
    start: float            # time.perf_counter() seconds (CLOCK_MONOTONIC: comparable across local processes)
    end: float              # the call returned (a blocking op), or its wait() did (an asynchronous one)
    tag: int = 0
    where: str = ""         # "file:line" of the caller
    meta: dict = field(default_factory=dict)    # "via": the native path used, when not torch.distributed's function
    issued: float | None = None     # asynchronous ops: the issuing call returned (None: a blocking call)
    waited: float | None = None     # asynchronous ops: wait() was called (None: never waited for)

    @property
    def is_comm(self) -> bool:
        return not self.op.startswith(REGIONS)

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
        """Communication events only (no span, api or compute regions)."""
        return [e for e in self.events if e.is_comm]

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
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one track per rank
        (:func:`minidist.trace.timeline.chrome_trace`); written to ``path`` when given."""
        from minidist.trace.timeline import chrome_trace, write_chrome_trace
        return write_chrome_trace(self, path) if path else chrome_trace(self)

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]


def merge(traces: Iterable[Trace | None]) -> Trace:
    """One trace from many ranks' traces (``None`` entries are skipped)."""
    return Trace(e for t in traces if t is not None for e in t.events)
