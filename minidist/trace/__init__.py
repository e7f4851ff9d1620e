"""Communication tracing: who talked to whom, how many bytes, and when.

Every path from Python to a collective or point-to-point op is wrapped once per process:
``torch.distributed``'s functions (:mod:`.functions`), ``ProcessGroup``/``Backend`` methods
and the functional collectives DTensor uses (:mod:`.native`). While a ``trace()`` is active
each call records an :class:`Event` (:mod:`.events`); a ``guard()`` makes chosen operations
raise, which is how labs forbid shortcuts ("build it from send/recv"); and the launcher reads
the operation each rank is blocked in, so a deadlock is reported as "rank 1 blocked in
recv(src=0)", and a timeout or a vanished peer is said in those terms (:mod:`.errors`).
:func:`compute` marks computation, so that :mod:`.timeline` can draw a run (Chrome/Perfetto
trace-event JSON) and measure its exposed communication: the time a rank waited on it.

Traces and guards are process-wide (:mod:`.state`): traffic from backward hooks that
autograd runs on its own threads, or from threads user code starts, is counted and guarded.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterable

import torch.distributed as dist

from minidist.trace import functions, native, state
from minidist.trace.calls import TracedWork, caller, check_guard
from minidist.trace.errors import CommTimeout, ForbiddenOperation, PeerGone, explain
from minidist.trace.events import COLLECTIVES, P2P_OPS, P2P_RECV, P2P_SEND, PEER_ARG, Event, Trace, merge
from minidist.trace.functions import INPUT_SECOND

_async_rewriters = state.async_rewriters     # minidist.runtime.strict_async appends its rewriter here
_installed = False

__all__ = ["Event", "Trace", "merge", "trace", "guard", "api", "span", "compute", "compute_since", "tracing",
           "ForbiddenOperation", "CommTimeout", "PeerGone", "P2P_SEND", "P2P_RECV", "P2P_OPS", "COLLECTIVES",
           "INPUT_SECOND", "PEER_ARG", "install", "set_op_listener", "explain", "TracedWork"]


def install() -> None:
    """Wrap every path to torch.distributed's ops once per process (idempotent)."""
    global _installed
    if _installed:
        return
    functions.install()
    native.install()
    _installed = True


def set_op_listener(listener: Callable[[str | None], None] | None) -> None:
    """The launcher's hook: told "recv(src=0, 4.0 KiB)" when an op starts, None when it ends."""
    state.listener = listener
    install()


@contextlib.contextmanager
def trace():
    """Record this rank's communication (every thread's) while the block runs: ``with trace() as t: ...``."""
    install()
    t = Trace()
    state.traces.append(t)
    try:
        yield t
    finally:
        state.traces.remove(t)


@contextlib.contextmanager
def guard(allow: Iterable[str] = ("send", "recv", "isend", "irecv"),
          why: str = "build it from send/recv (isend/irecv) only"):
    """Make every traced operation outside ``allow`` raise :class:`ForbiddenOperation`, on any thread.

    Names are torch.distributed op names ("all_reduce") and minidist api names
    ("minidist.ring_all_reduce", see :func:`api`).
    """
    install()
    entry = (frozenset(allow), why)
    state.guards.append(entry)
    try:
        yield
    finally:
        state.guards.remove(entry)


def api(name: str):
    """Decorator for minidist's own implementations: guard-checked, and recorded as a region."""
    qualified = f"minidist.{name}"

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            check_guard(qualified, caller())
            if not state.traces:
                return fn(*args, **kwargs)
            with span(f"api:{name}", _kind=None):
                return fn(*args, **kwargs)
        return wrapper
    return deco


@contextlib.contextmanager
def span(name: str, _kind: str | None = "span", **meta):
    """A named region (e.g. a pipeline stage's forward of micro-batch 3) for timelines."""
    start = time.perf_counter()
    try:
        yield
    finally:
        recording = tuple(state.traces)
        if recording:
            rank = dist.get_rank() if dist.is_initialized() else 0
            op = f"{_kind}:{name}" if _kind else name
            event = Event(op, rank, None, None, 0, start, time.perf_counter(), meta=meta)
            for t in recording:
                t.events.append(event)


def tracing() -> bool:
    """Whether any ``trace()`` is open (on any thread): what code asks before it times itself."""
    return bool(state.traces)


@contextlib.contextmanager
def compute(name: str, **meta):
    """A region of computation (a chunk's matmul, a layer's forward), recorded as ``compute:NAME``
    for timelines; with no trace open it costs one check."""
    if not state.traces:
        yield
        return
    with span(name, _kind="compute", **meta):
        yield


def compute_since(name: str, start: float, **meta) -> None:
    """Record ``compute:NAME`` from ``start`` (a ``time.perf_counter()``) to now: for computation
    that begins in one hook and ends in another (a module's forward, seen from its hooks)."""
    recording = tuple(state.traces)
    if recording:
        rank = dist.get_rank() if dist.is_initialized() else 0
        event = Event(f"compute:{name}", rank, None, None, 0, start, time.perf_counter(), meta=meta)
        for t in recording:
            t.events.append(event)
