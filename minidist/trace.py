"""Communication tracing: who talked to whom, how many bytes, and when.

Every point-to-point and collective call that goes through ``torch.distributed``
(``dist.send``, ``dist.all_reduce``, ...) is wrapped once per process. While a
``trace()`` is active the wrapper records an :class:`Event` per call; a ``guard()``
makes chosen operations raise, which is how labs forbid shortcuts ("build it from
send/recv"); and the launcher reads the operation each rank is blocked in, so a
deadlock is reported as "rank 1 blocked in recv(src=0)".

Bytes are payload bytes as the caller sees them: ``send``/``isend`` count as sent,
``recv``/``irecv`` as received, a collective counts its input tensor(s) once: the list
form ``all_gather(outputs, x)`` counts ``x``, exactly as ``all_gather_into_tensor(out, x)``
does, never the N outputs it fills. For
minidist's own algorithms, which are built from send/recv, that is exactly the
traffic on the wire, which is what the α-β model in ``minidist.cost`` predicts.

Calls are wrapped at the module attribute (``torch.distributed.send``), so code
must call ``dist.send(...)``; ``from torch.distributed import send`` made before
the wrapping bypasses it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, asdict
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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
# Collectives whose input is the second argument (the first is the output buffer).
INPUT_SECOND = {"all_gather", "all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor",
                "all_gather_into_tensor", "reduce_scatter_single", "all_gather_single"}
PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


class ForbiddenOperation(RuntimeError):
    """Raised when a guarded region calls an operation it does not allow."""


class CommTimeout(RuntimeError):
    """An operation outlived the process-group timeout: nobody posted its other half."""


class PeerGone(RuntimeError):
    """The rank on the other side of an operation exited or crashed."""


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
    meta: dict = field(default_factory=dict)

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


# --------------------------------------------------------------------------------------
# Process-wide recording state. Lists rather than single values so that traces and
# guards nest; thread-local because a rank may run helper threads that must not mix in.
_state = threading.local()
_op_listener: Callable[[str | None], None] | None = None   # set by the launcher
# How an asynchronous call is rewritten, (name, fn, args, kwargs, where) -> (args, kwargs, land) or None,
# where land() writes the outputs (once) when the handle completes (minidist.runtime.strict_async).
# Process-wide, not per thread: on GPUs autograd runs gradient hooks, which launch async ops, on its own threads.
_async_rewriters: list[Callable] = []
_installed = False


def _stack(name):
    s = getattr(_state, name, None)
    if s is None:
        s = []
        setattr(_state, name, s)
    return s


def set_op_listener(listener: Callable[[str | None], None] | None) -> None:
    """The launcher's hook: told "recv(src=0, 4.0 KiB)" when an op starts, None when it ends."""
    global _op_listener
    _op_listener = listener
    install()


def _caller() -> str:
    f = sys._getframe(2)
    here = __file__
    while f is not None and (f.f_code.co_filename == here or "/torch/distributed/" in f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _describe(op: str, peer, nbytes: int) -> str:
    size = (f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:.1f} KiB" if nbytes < 1 << 20
            else f"{nbytes / (1 << 20):.1f} MiB")
    if peer is not None:
        return f"{op}({PEER_ARG[op]}={peer}, {size})"
    return f"{op}({size})" if nbytes else f"{op}()"


def _short(where: str) -> str:
    """'notebook cell, line 4' for code typed in Jupyter, 'file.py:4' otherwise."""
    path, _, line = where.rpartition(":")
    if re.search(r"ipykernel_\d+|<ipython-input", path):
        return f"notebook cell, line {line}"
    return where.rsplit("/", 1)[-1]


def _check_guard(name: str, where: str) -> None:
    for allow, why in _stack("guards"):
        if name not in allow:
            raise ForbiddenOperation(f"{name} is not allowed here ({_short(where)}): {why}")


class _TracedWork:
    """Wraps an async Work so that the event's end time is the moment wait() returns; under
    :func:`minidist.runtime.strict_async.outputs_at_wait` the outputs land only then (or when
    ``is_completed()`` or the work's future says it is done), once."""

    def __init__(self, work, event: Event | None, description: str, land: Callable | None = None):
        self._work, self._event, self._description, self._land = work, event, description, land

    def _outputs(self):
        return self._land() if self._land is not None else None

    def wait(self, *args, **kwargs):
        listener = _op_listener
        if listener:
            listener(f"wait() on {self._description}")
        try:
            done = self._work.wait(*args, **kwargs)
        except RuntimeError as err:
            clearer = _explain(err, self._description)
            if clearer is None:
                raise
            raise clearer from None
        finally:
            if self._event is not None:
                self._event.end = time.perf_counter()
                if self._event.op == "irecv" and self._event.peer is None:    # irecv from any source
                    try:
                        self._event.peer = self._work._source_rank()
                    except (RuntimeError, AttributeError):
                        pass
            if listener:
                listener(None)
        self._outputs()
        return done

    def is_completed(self):
        done = self._work.is_completed()
        if done:
            self._outputs()
        return done

    def get_future(self):
        future = self._work.get_future()
        if self._land is None:
            return future
        return future.then(lambda done: (done.value(), self._outputs())[1])

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        depth = _stack("depth")
        if depth:  # called by another traced op (e.g. all_gather_object -> all_gather)
            return fn(*args, **kwargs)
        where = _caller()
        _check_guard(name, where)
        if name == "batch_isend_irecv":     # its isend/irecv are traced one by one instead
            batch = _stack("batch")
            batch.append(name)              # ... and never rewritten: NCCL returns one work for the group
            try:
                return fn(*args, **kwargs)
            finally:
                batch.pop()
        group = kwargs.get("group")
        peer = None
        if name in PEER_ARG:
            peer = kwargs.get(PEER_ARG[name], args[1] if len(args) > 1 else None)
            gpeer = kwargs.get("group_" + PEER_ARG[name])
            if peer is None and gpeer is not None and group is not None:
                peer = dist.get_global_rank(group, gpeer)
        if peer is not None and peer == dist.get_rank():
            raise ValueError(f"rank {peer} called {name}() with itself as the peer ({_short(where)}): "
                             f"a rank cannot {'send to' if name in P2P_SEND else 'receive from'} itself")
        payload = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("tensor_list")))
        if name in INPUT_SECOND:
            payload = args[1] if len(args) > 1 else kwargs.get("input_list", kwargs.get("input", kwargs.get("input_tensor", kwargs.get("tensor"))))
        nbytes = _nbytes(payload)
        description = _describe(name, peer, nbytes)
        land = None
        if _async_rewriters and not _stack("batch"):
            rewritten = _async_rewriters[-1](name, fn, args, kwargs, _short(where))
            if rewritten is not None:
                args, kwargs, land = rewritten
        listener = _op_listener
        if listener:
            listener(description)
        recording = _stack("traces")
        event = None
        start = time.perf_counter()
        depth.append(name)
        try:
            result = fn(*args, **kwargs)
        except RuntimeError as err:
            clearer = _explain(err, description)
            if clearer is None:
                raise
            raise clearer from None
        finally:
            depth.pop()
            end = time.perf_counter()
            if listener:
                listener(None)
        if name == "recv" and peer is None and isinstance(result, int):
            peer = result           # recv() from any source returns who sent it
        if recording:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
            event = Event(name, dist.get_rank(), peer, ranks, nbytes, start, end,
                          kwargs.get("tag", 0), where)
            for t in recording:
                t.events.append(event)
        if result is not None and hasattr(result, "wait") and not isinstance(result, list):
            return _TracedWork(result, event, description, land)
        if land is not None:        # no handle (this rank is not in the group): nothing to wait for
            land()
        return result

    traced.__minidist_traced__ = True
    return traced


def _explain(err: RuntimeError, description: str) -> RuntimeError | None:
    """Gloo's timeout and peer-crash messages, said in terms of the op the user called."""
    msg = str(err).split("\nException raised from")[0].strip()
    if "Timed out" in msg or "timed out" in msg:
        return CommTimeout(f"{description} did not complete before the process-group timeout: "
                           f"no matching operation on the other side (a deadlock?)")
    if "Connection closed by peer" in msg or "Connection reset" in msg:
        return PeerGone(f"{description} failed: a peer rank exited or crashed first")
    return None


def install() -> None:
    """Wrap torch.distributed's ops once per process (idempotent)."""
    global _installed
    if _installed:
        return
    for name in sorted(P2P_OPS | COLLECTIVES):
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__minidist_traced__", False):
            continue
        wrapped = _wrap(name, fn)
        # Both modules: P2POp and batch_isend_irecv look isend/irecv up in distributed_c10d.
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    _installed = True


@contextlib.contextmanager
def trace():
    """Record this rank's communication while the block runs: ``with trace() as t: ...``."""
    install()
    t = Trace()
    stack = _stack("traces")
    stack.append(t)
    try:
        yield t
    finally:
        stack.remove(t)


@contextlib.contextmanager
def guard(allow: Iterable[str] = ("send", "recv", "isend", "irecv"),
          why: str = "build it from send/recv (isend/irecv) only"):
    """Make every traced operation outside ``allow`` raise :class:`ForbiddenOperation`.

    Names are torch.distributed op names ("all_reduce") and minidist api names
    ("minidist.ring_all_reduce", see :func:`api`).
    """
    install()
    entry = (frozenset(allow), why)
    stack = _stack("guards")
    stack.append(entry)
    try:
        yield
    finally:
        stack.remove(entry)


def api(name: str):
    """Decorator for minidist's own implementations: guard-checked, and recorded as a region."""
    qualified = f"minidist.{name}"

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            _check_guard(qualified, _caller())
            if not _stack("traces"):
                return fn(*args, **kwargs)
            with span(f"api:{name}", _kind=None):
                return fn(*args, **kwargs)
        return wrapper
    return deco


@contextlib.contextmanager
def span(name: str, _kind: str | None = "span", **meta):
    """A named region (e.g. a pipeline stage's forward of micro-batch 3) for timelines."""
    recording = _stack("traces")
    start = time.perf_counter()
    try:
        yield
    finally:
        if recording:
            rank = dist.get_rank() if dist.is_initialized() else 0
            op = f"{_kind}:{name}" if _kind else name
            event = Event(op, rank, None, None, 0, start, time.perf_counter(), meta=meta)
            for t in recording:
                t.events.append(event)
