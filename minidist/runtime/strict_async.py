"""The strictest executions torch.distributed's asynchronous operations allow, so a check never depends on a race.

An ``async_op=True`` collective or an ``irecv`` returns a handle; the API promises the output only
once the handle has completed (``wait()``), and a buffer handed to an operation must not be touched
until then (torch.distributed docs, "Synchronous and asynchronous collective operations"). Code that
reads an output early, waits for some handles only (gloo runs collectives on several threads, so
they need not finish in order), or never waits, is wrong, but on a tiny CPU model it is right most of
the time: the operation usually finishes first. A check that runs such code once passes it by luck.

* :func:`outputs_at_wait` makes that luck impossible: an asynchronous operation reads its input when
  it is launched and writes its output only when its handle is waited for (``wait()``,
  ``is_completed()`` returning True, or its future). Both are the legal extremes, so every correct
  program gives the same result, and a handle that is never waited for leaves its output untouched
  on every run; leaving the block with such a handle raises :class:`UnwaitedHandle`, naming the
  operation and the line that launched it. ``batch_isend_irecv`` groups are left as they are (NCCL
  returns one handle for them), and so is ``isend`` (whose handle a pipeline may wait for at the end).
* :func:`blocking_p2p` is the other extreme for point-to-point order: every ``isend``/``irecv`` waits
  until its partner has posted the matching op (NCCL's strictest case), so an order that only works
  because operations are asynchronous deadlocks every time.
* :func:`coalesced_batches` makes ``batch_isend_irecv`` return what NCCL returns: one handle for the
  whole batch, whose ``wait()`` lands every receive of it. Code that pairs handles with ops by index
  never waits for some receives, and reads them unwritten.
* :func:`host_does_not_wait` gives ``wait()`` its CUDA meaning (see there): it returns at once, before
  the data land, and only the next operation on the tensors is ordered after them.

The lab checks run every launch under :func:`outputs_at_wait`; the rewriting happens inside the
tracer's wrapper (:mod:`minidist.trace`), which every ``torch.distributed`` call goes through.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minidist import trace
from minidist.trace import state as trace_state

#: op -> (its output parameter, its separate input parameter or None when it works in place)
OUTPUT_AND_INPUT = {
    "all_reduce": ("tensor", None), "broadcast": ("tensor", None), "reduce": ("tensor", None),
    "irecv": ("tensor", None),
    "all_gather": ("tensor_list", "tensor"), "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "all_gather_single": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output", "input_list"), "reduce_scatter_tensor": ("output", "input"),
    "reduce_scatter_single": ("output", "input"),
    "all_to_all": ("output_tensor_list", "input_tensor_list"), "all_to_all_single": ("output", "input"),
    "gather": ("gather_list", "tensor"), "scatter": ("tensor", "scatter_list"),
}
ALWAYS_ASYNC = {"irecv"}
_unwaited: dict[int, str] = {}        # id(land) -> "all_reduce (notebook cell, line 12)"


class UnwaitedHandle(RuntimeError):
    """Code launched an asynchronous operation and never waited for its handle."""


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def _copy(value):
    """A private copy of a tensor or a list of tensors (strides kept, so the op accepts it as it would the original)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return [t.detach().clone() for t in value]


def _tensors(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _late(name: str, fn, args: tuple, kwargs: dict, where: str):
    """The tracer's rewriter: an asynchronous call runs on private copies; ``land`` copies its result back."""
    spec = OUTPUT_AND_INPUT.get(name)
    if spec is None:
        return None
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None                  # let torch report the bad call itself
    if name not in ALWAYS_ASYNC and not bound.arguments.get("async_op", False):
        return None
    out_name, in_name = spec
    outputs = bound.arguments.get(out_name)
    if outputs is None:
        return None                  # e.g. gather's list on a rank that is not the destination
    private = _copy(outputs)
    bound.arguments[out_name] = private
    if in_name is not None and bound.arguments.get(in_name) is not None:
        bound.arguments[in_name] = _copy(bound.arguments[in_name])      # read now, as at launch

    # Reentrant, and marked landed before copying: under host_does_not_wait the copy itself is a torch
    # call, which first lands whatever is pending, this handle included.
    lock, landed = threading.RLock(), []

    def land() -> list[torch.Tensor]:     # once, whoever calls first (wait(), or a future's callback thread)
        with lock:
            if not landed:
                landed.append(True)
                _unwaited.pop(id(land), None)
                with torch.no_grad():
                    for mine, result in zip(_tensors(outputs), _tensors(private)):
                        mine.copy_(result)
        return _tensors(outputs)
    land.outputs = _tensors(outputs)      # what a future completed at launch hands out (host_does_not_wait)
    _unwaited[id(land)] = f"{name} ({where})"
    return bound.args, bound.kwargs, land


@contextlib.contextmanager
def outputs_at_wait():
    """While active (in this process): an asynchronous operation's output is written when its
    handle is waited for; leaving normally with a handle never waited for raises :class:`UnwaitedHandle`."""
    trace.install()
    _unwaited.clear()
    trace._async_rewriters.append(_late)
    try:
        yield
    finally:
        trace._async_rewriters.remove(_late)
    check_all_waited()


def check_all_waited() -> None:
    """Raise :class:`UnwaitedHandle` if an operation launched under :func:`outputs_at_wait` was never
    waited for (a check calls it between its cases, so the error names the case that left it)."""
    _land_pending()             # waited for under host_does_not_wait, not landed yet: those were waited for
    if not _unwaited:
        return
    counts = Counter(_unwaited.values())
    _unwaited.clear()
    ops = "; ".join(f"{n} × {op}" for op, n in sorted(counts.items()))
    raise UnwaitedHandle(f"asynchronous operations never waited for: {ops}. The output of an async_op=True "
                         f"collective or an irecv is there only once its handle's wait() has returned: wait for "
                         f"every handle before using its result.")


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


@contextlib.contextmanager
def blocking_p2p():
    """Every isend/irecv waits until its partner has posted the matching op (NCCL's strictest case);
    a ``batch_isend_irecv`` stays one group posted together, as NCCL runs it. An order that only
    works because ops are asynchronous deadlocks here."""
    saved = {n: getattr(dist, n) for n in ("isend", "irecv", "batch_isend_irecv")}

    def blocking(fn):
        def op(*args, **kwargs):
            work = fn(*args, **kwargs)
            if work is not None:
                work.wait()
            return _Done()
        return op

    patched = {"isend": blocking(saved["isend"]), "irecv": blocking(saved["irecv"])}
    real = {patched["isend"]: saved["isend"], patched["irecv"]: saved["irecv"],
            saved["isend"]: saved["isend"], saved["irecv"]: saved["irecv"]}

    def batch(ops):
        # Under a torch-function mode (set_default_device's), torch's isend re-dispatches to the module's
        # isend, which is the blocking one here: one group would block op by op. Modes off for the real ops.
        with torch._C.DisableTorchFunction():
            works = [real.get(o.op, o.op)(o.tensor, o.peer, o.group, o.tag) for o in ops]
        return [w for w in works if w is not None]

    patched["batch_isend_irecv"] = batch
    try:
        for n, fn in patched.items():
            setattr(dist, n, fn)
            setattr(c10d, n, fn)
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
            setattr(c10d, n, fn)


class _Coalesced:
    """NCCL's handle for a whole ``batch_isend_irecv``: done when every op of it is, receives landed then."""

    def __init__(self, works, land):
        self._works, self._land = works, land

    def wait(self, *args, **kwargs):
        for w in self._works:
            w.wait(*args, **kwargs)
        self._land()
        return True

    def is_completed(self):
        done = all(w.is_completed() for w in self._works)
        if done:
            self._land()
        return done


@contextlib.contextmanager
def coalesced_batches():
    """``batch_isend_irecv`` returns one handle for the batch, as it does on NCCL (torch 2.13 returns
    ``cm.works`` of its coalescing manager there: one work), and the batch's receives land only when
    that handle is waited for. Code must wait for every handle it is given, whatever their number."""
    saved = dist.batch_isend_irecv

    def batch(ops):
        ops = list(ops)
        if not ops:
            return saved(ops)
        private = {}                        # index -> (the caller's buffer, the one really received into)
        posted = []
        for i, op in enumerate(ops):
            if op.op in (dist.irecv, c10d.irecv):
                private[i] = (op.tensor, op.tensor.detach().clone())
                op = dist.P2POp(op.op, private[i][1], group=op.group, tag=op.tag, group_peer=op.group_peer)
            posted.append(op)
        works = saved(posted)

        def land():
            with torch.no_grad():
                for mine, got in private.values():
                    mine.copy_(got)
        return [_Coalesced(works, land)]

    try:
        dist.batch_isend_irecv = c10d.batch_isend_irecv = batch
        yield
    finally:
        dist.batch_isend_irecv = c10d.batch_isend_irecv = saved


# ------------------------------------------------------------------------------ host_does_not_wait
_pending: list = []         # handles whose wait() returned before their data landed, oldest first


def _land_pending() -> None:
    while _pending:
        try:
            work = _pending.pop(0)
        except IndexError:      # another thread took the last one
            return
        work.complete()


class _Stream(torch.overrides.TorchFunctionMode):
    """The CUDA stream, emulated: a torch call runs only after what a wait() put ahead of it has landed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _land_pending()         # torch runs this handler with the mode off: landing's own copies pass straight
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_does_not_wait():
    """``wait()`` as on CUDA: it returns to the host at once, before the data land.

    On a GPU, ``work.wait()`` only makes the current stream wait for the communication stream, and a
    work's future completes when the op is enqueued; the host runs ahead. The data land on the device
    later, but before any kernel that the stream runs after the wait, so a program that waits, then
    uses the result, computes the same thing; one that uses it without waiting reads stale memory.

    Emulated on CPU: in this thread, ``wait()`` on a handle (and ``get_future()``, whose future is
    complete at once, its value the output tensors) only queues the handle and returns. The queue is
    the stream: every torch call in this thread (a kernel, and also a host read such as ``tolist()``,
    ``item()`` or ``print``, which on CUDA synchronises) first completes the queued handles on the host
    and lands their outputs, oldest first. So data land after ``wait()`` has returned, at the latest
    point at which a correct program could observe them, and a correct program's results do not change.
    (Without :func:`outputs_at_wait` gloo may write an output earlier, any time after the launch: a
    correct program cannot tell that apart either.) Under :func:`outputs_at_wait` a handle never waited
    for is still never landed and still named when the block ends; what was waited for is landed when
    this block ends, if nothing used it before.
    Threads that do not run inside the block (``threading.Thread``) keep CPU semantics: their ``wait()``
    blocks. Blocking calls (``async_op=False``) still block, one of the two legal extremes.
    """
    trace.install()
    mode = _Stream()

    def defer(work) -> bool:
        if not any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
            return False        # another thread, or inside a torch call of this one: wait on the host
        _pending.append(work)
        return True

    trace_state.wait_hooks.append(defer)
    try:
        with mode:
            yield
    except BaseException:
        _pending.clear()
        raise
    finally:
        trace_state.wait_hooks.remove(defer)
    _land_pending()
