"""The tracer's state: process-wide, except what belongs to one thread's call stack.

A rank is one process, and its communication happens on more threads than the one that
opened a ``trace()``: autograd runs backward hooks (which all-reduce gradients in data
parallelism, FSDP, tensor parallelism) on its own device threads on GPUs, and for some
graphs on CPU too; user code may start threads. So open traces, guards, asynchronous
rewriters and the launcher's listener are shared by every thread of the process: traffic
from any thread is counted, and a forbidden op on any thread raises.

Per thread stays only what describes a thread's own call stack: ``depth`` (the traced
calls this thread is inside, so that ``all_gather_object`` -> ``all_gather`` ->
``ProcessGroup.allgather`` is one event, while a call on another thread at the same
moment is not mistaken for a nested one) and ``batch`` (this thread is inside a
``batch_isend_irecv``). No locks: appends, removes and snapshots of lists are atomic
under the GIL, and a lock held by another thread at ``fork`` would hang the forked rank.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

traces: list = []                   # open trace() blocks, innermost last
guards: list = []                   # open guard() entries: (allowed names, why)
# How an asynchronous call is rewritten, (name, fn, args, kwargs, where) -> (args, kwargs, land) or None,
# where land() writes the outputs (once) when the handle completes (minidist.runtime.strict_async).
async_rewriters: list[Callable] = []
# How a handle's wait() behaves, (work, land) -> None; empty: wait on the host, then land
# (minidist.runtime.strict_async.host_does_not_wait replaces it, as CUDA does).
wait_hooks: list[Callable] = []
listener: Callable[[str | None], None] | None = None     # the launcher's: which op this rank is in
# thread id -> the op it is in now (the listener hears the latest). Private: threads change it while
# graded code runs, and the checks take a change to one of minidist's public tables for tampering.
_active: dict[int, str] = {}

_local = threading.local()


def _forget() -> None:
    """A forked process starts with nothing open, as a spawned one does: a trace or guard that another
    thread of the parent held at the fork is that thread's, and the child has no such thread."""
    global listener
    for shared in (traces, guards, async_rewriters, wait_hooks, _active):
        shared.clear()
    listener = None


os.register_at_fork(after_in_child=_forget)


def entered(description: str) -> None:
    """This thread is now in ``description``; the launcher is told."""
    if listener is not None:
        _active[threading.get_ident()] = description
        listener(description)


def left() -> None:
    """This thread's op is over: the launcher is told the op another thread is still in, if any."""
    if listener is not None:
        _active.pop(threading.get_ident(), None)
        still = list(_active.values())       # one step under the GIL: another thread may be changing it
        listener(still[-1] if still else None)


def per_thread(name: str) -> list:
    """This thread's list ``name`` ("depth" or "batch"), created empty on first use."""
    s = getattr(_local, name, None)
    if s is None:
        s = []
        setattr(_local, name, s)
    return s
