"""One traced call: guard it, tell the launcher, record an event, wrap the handle it returns.

Every path to a collective (``torch.distributed``'s functions, ``ProcessGroup`` methods,
functional collectives; see :mod:`.functions` and :mod:`.native`) ends here, so they are all
counted, guarded and explained alike.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from minidist.protocol import NOTEBOOK_CELL
from minidist.trace import state
from minidist.trace.errors import ForbiddenOperation, explain, where_in_notebook
from minidist.trace.events import PEER_ARG, Event

_SKIPPED = (os.path.dirname(os.path.abspath(__file__)) + os.sep,      # this package
            os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)  # torch (funcol, DTensor, autograd)


def caller() -> str:
    """"file:line" of the code that called into the tracer (torch's own frames skipped)."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_SKIPPED) or "/torch/distributed/" in f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def short(where: str) -> str:
    """'notebook cell "ring", line 4' for code typed in Jupyter (the cell by its title), 'file.py:4' otherwise."""
    path, _, line = where.rpartition(":")
    if NOTEBOOK_CELL.search(path):
        return where_in_notebook(path, int(line)) if line.isdigit() else f"notebook cell, line {line}"
    return where.rsplit("/", 1)[-1]


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    return 0


def describe(op: str, peer, size: int) -> str:
    shown = (f"{size} B" if size < 1024 else f"{size / 1024:.1f} KiB" if size < 1 << 20
             else f"{size / (1 << 20):.1f} MiB")
    if peer is not None:
        return f"{op}({PEER_ARG[op]}={peer}, {shown})"
    return f"{op}({shown})" if size else f"{op}()"


def check_guard(name: str, where: str) -> None:
    for allow, why in tuple(state.guards):
        if name not in allow:
            raise ForbiddenOperation(f"{name} is not allowed here ({short(where)}): {why}")


def group_ranks(group) -> tuple | None:
    """Global ranks of ``group``; None for the default group (``group=None``) or one torch does not know."""
    if group is None:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):
        return None


def global_rank(group, rank: int | None) -> int | None:
    """The global rank of ``rank`` in ``group`` (unchanged for the default group)."""
    if rank is None or group is None:
        return rank
    try:
        return dist.get_global_rank(group, rank)
    except (RuntimeError, ValueError, KeyError):
        return rank


def record(op: str, peer, group, size: int, start: float, end: float, tag, where: str, meta=None) -> Event | None:
    recording = tuple(state.traces)
    if not recording:
        return None
    event = Event(op, dist.get_rank(), peer, group_ranks(group), size, start, end, tag or 0, where, meta or {})
    for t in recording:
        t.events.append(event)
    return event


def call(name: str, fn: Callable, args, kwargs, *, where: str, size: int, peer=None, group=None, tag=0,
         land: Callable | None = None, meta: dict | None = None):
    """Run ``fn(*args, **kwargs)`` as the traced op ``name`` (guard already checked)."""
    description = describe(name, peer, size)
    state.entered(description)
    depth = state.per_thread("depth")
    start = time.perf_counter()
    depth.append(name)
    try:
        result = fn(*args, **kwargs)
    except RuntimeError as err:
        clearer = explain(err, description)
        if clearer is None:
            raise
        raise clearer from None
    finally:
        depth.pop()
        end = time.perf_counter()
        state.left()
    if name == "recv" and peer is None and isinstance(result, int):
        peer = result           # recv() from any source returns who sent it
    event = record(name, peer, group, size, start, end, tag, where, meta)
    if hasattr(result, "wait") and not isinstance(result, (list, torch.Tensor)):
        if event is not None:
            event.issued = end          # in flight from here until wait() returns
        return TracedWork(result, event, description, land)
    if land is not None:        # no handle (this rank is not in the group): nothing to wait for
        land()
    return result


class TracedWork:
    """Wraps an async Work so that the event's end time is the moment wait() returns; under
    :func:`minidist.runtime.strict_async.outputs_at_wait` the outputs land only then (or when
    ``is_completed()`` or the work's future says it is done), once. Under a wait hook
    (:func:`minidist.runtime.strict_async.host_does_not_wait`) wait() may return before that."""

    def __init__(self, work, event: Event | None, description: str, land: Callable | None = None):
        self._work, self._event, self._description, self._land = work, event, description, land

    def _outputs(self):
        return self._land() if self._land is not None else None

    def wait(self, *args, **kwargs):
        if self._event is not None and self._event.waited is None:
            self._event.waited = time.perf_counter()      # from here the host is blocked on it
        hooks = state.wait_hooks
        if hooks and not args and not kwargs and hooks[-1](self):
            if self._event is not None:     # the host's view: wait() returned now
                self._event.end = time.perf_counter()
            return True
        return self.complete(*args, **kwargs)

    def complete(self, *args, **kwargs):
        """Block until the operation is done, then land its outputs (what wait() does on a CPU)."""
        if self._event is not None and self._event.waited is None:
            self._event.waited = time.perf_counter()
        state.entered(f"wait() on {self._description}")
        try:
            done = self._work.wait(*args, **kwargs)
        except RuntimeError as err:
            clearer = explain(err, self._description)
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
            state.left()
        self._outputs()
        return done

    def is_completed(self):
        done = self._work.is_completed()
        if done:
            self._outputs()
        return done

    def get_future(self):
        hooks = state.wait_hooks
        if self._land is not None and hooks and hooks[-1](self):
            future = torch.futures.Future()     # as on CUDA: complete at once, the data ordered behind it
            future.set_result(list(self._land.outputs))
            return future
        future = self._work.get_future()
        if self._land is None:
            return future
        return future.then(lambda done: (done.value(), self._outputs())[1])

    def __getattr__(self, name):
        return getattr(self._work, name)
