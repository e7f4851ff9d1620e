"""Measured memory: what a rank actually holds, not what a formula says it should.

Two measurements, to set next to the ZeRO formulas in :mod:`minidist.cost`:

* :func:`model_state_bytes` — bytes of the *storages* behind the live parameter,
  gradient and optimizer-state tensors. Storages, not ``numel``: a parameter that is a
  view into a flat buffer costs the whole buffer (padding included), a tensor whose
  storage was freed (ZeRO-3 between layers) costs 0, and a storage shared by several
  tensors (a shard that is a view of the flat parameter) is counted once.
* :func:`peak_bytes` — the peak of live memory while a function runs. On GPU,
  ``torch.cuda.max_memory_allocated``; on CPU, the profiler's allocation timeline
  (every allocation and free, in order), whose running total is the live-memory curve.
* :class:`LiveBytes` — every byte of CPU tensors the process holds throughout each named phase
  of a run (forward, backward, step), whoever holds them: a buffer kept for reuse counts,
  which :func:`model_state_bytes`, reading only the states, does not see.
* :class:`ActivationMeter` — the bytes autograd keeps for backward (saved-tensor hooks),
  per forward call, exactly: what the activation-memory formulas of pipeline and tensor
  parallelism predict. :func:`saved_activation_bytes` is its one-call form. It is the
  only such counter: the pipeline executor, the lab checks, the tour and the tests use it.
"""
from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager

import torch
import torch.nn as nn


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct non-empty storages behind ``tensors`` (``seen`` is shared across calls)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        if key[3] == 0 or key in seen:
            continue
        seen.add(key)
        total += key[3]
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def model_state_bytes(params, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"}: storage bytes held right now.

    ``params``: every parameter-like tensor the rank holds (module parameters and, for
    ZeRO, its shards); their ``.grad`` are the gradients. A storage is counted once, in
    the first category that reaches it.
    """
    params = list(params)
    seen: set = set()
    out = {"params": storage_bytes(params, seen),
           "grads": storage_bytes([p.grad for p in params if p.grad is not None], seen),
           "optimizer": storage_bytes(optimizer_state_tensors(optimizer) if optimizer else [], seen)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


PHASE = "minidist.phase:"      # the record_function names of LiveBytes' phases


def _cpu_timeline(prof) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """From a profile taken with profile_memory=True: (time, signed size, the allocator's running
    total after it) of every CPU allocation and free recorded, in time order, and (name, start,
    end) of every LiveBytes phase."""
    from torch._C._profiler import _EventType
    events, phases, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        elif node.name.startswith(PHASE):
            phases.append((node.name[len(PHASE):], node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    return sorted(events, key=lambda e: e[0]), phases


@contextmanager
def _every_thread_counted():
    """c10's CPU allocator keeps its running total of live bytes (the one profiler events carry)
    for every thread only with FLAGS_caffe2_report_cpu_memory_usage; otherwise a tensor freed on
    a thread the profiler does not watch (gloo frees a collective's buffers on its own threads)
    stays counted for ever. The flag has no Python binding: set it through the library's symbol."""
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
                                    "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as err:
        raise RuntimeError(f"counting CPU memory needs c10's FLAGS_caffe2_report_cpu_memory_usage: {err}") from None
    before, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = before


def peak_bytes(fn, *args, device: torch.device | str = "cpu", **kwargs) -> tuple[object, int, int]:
    """Run ``fn``; return (its result, peak bytes above the level at the start, net change).

    The net change is what ``fn`` left allocated (e.g. gradients created during a step),
    so ``states_after - net + peak`` is the absolute peak when ``states_after`` is what
    the rank holds at the end. On CPU the level is the allocator's running total, which
    counts every thread's frees (gloo's included); it is read at the allocations and frees
    of the calling thread.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base, torch.cuda.memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    with _every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    events = _cpu_timeline(prof)[0]
    if not events:
        return result, 0, 0
    start = events[0][2] - events[0][1]
    return result, max(0, max(total for _, _, total in events) - start), events[-1][2] - start


class LiveBytes:
    """Every byte of CPU tensors this process holds throughout each named phase of a run.

    ``with meter.recording(): ... with meter.phase("step"): ...``; afterwards ``meter.held[name]``
    is the least that was live while the phase ran (the most of those, if it ran several times),
    counted from where the recording began: what the phase held from start to end, every tensor
    of every thread whoever holds it (a buffer kept for reuse counts). The least, not the level at
    one moment: gloo's threads free a finished collective's buffers a little later, and at one
    moment those would count or not depending on the load. The level is the CPU allocator's own
    running total, read from the profiler's allocation events.
    """

    def __init__(self):
        self.held: dict[str, int] = {}

    @contextmanager
    def recording(self):
        from torch.profiler import ProfilerActivity, profile
        # Python's cycle collector frees garbage (an earlier model and its hooks) whenever it
        # runs: inside the recording, those frees would land at random and move the level.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with _every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                yield self
        finally:
            if was_enabled:
                gc.enable()
        events, phases = _cpu_timeline(prof)
        start = events[0][2] - events[0][1] if events else 0
        for name, begin, end in phases:
            level = [total for t, _, total in events if t < begin][-1:] or [start]
            held = min(level + [total for t, _, total in events if begin <= t <= end]) - start
            self.held[name] = max(held, self.held.get(name, held))

    @staticmethod
    def phase(name: str):
        return torch.profiler.record_function(PHASE + name)


# ----------------------------------------------------------------------------- activations
def _span(t: torch.Tensor):
    """(storage key, first byte, one past the last byte) of the memory ``t`` can read.

    A view's span, not its storage's: a micro-batch sliced out of a batch holds its own
    rows, and Q, K and V viewed out of one projection output cover it once between them."""
    es = t.element_size()
    start = t.storage_offset() * es
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))     # element offset of the far corner
    return _storage_key(t), start, start + (last + 1) * es


def _union(spans) -> int:
    total, reach = 0, -1
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


class ActivationMeter:
    """The one exact count of the bytes autograd keeps for backward (saved-tensor hooks).

    A saved tensor counts the bytes it spans in its storage; tensors that overlap in one
    storage (views of one buffer) count their union once; storages of ``exclude`` (model
    state: parameters, buffers such as a causal mask) never count. Every dtype counts (a
    bool dropout mask is 1 byte per element). A tensor counts from the forward that saves
    it until autograd releases it (the backward that consumes it has run, or the graph was
    dropped), so ``bytes`` is what is held now and ``peak_bytes`` the most held at once.
    Forward calls are numbered (:meth:`recording`, :class:`Metered`) so that
    ``peak_calls`` says how many of them held activations at once (micro-batches, in a
    pipeline). Checked against the formulas of :mod:`minidist.cost` (pipeline, tensor
    parallelism) to the byte.
    """

    def __init__(self, exclude=()):
        self.skip = {_storage_key(q) for q in exclude}
        self.spans: dict[tuple, dict[tuple, int]] = {}    # storage -> (start, end) -> holders alive
        self.covered: dict[tuple, int] = {}               # storage -> bytes of the union of its spans
        self.calls: dict[int, int] = {}                   # forward call -> holders alive
        self.bytes = self.peak_bytes = 0
        self.peak_calls = 0
        self.call = 0

    @contextmanager
    def recording(self):
        """Count what autograd saves inside the block, as one more forward call."""
        self.call += 1
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self

    def pack(self, t):
        if t.numel() == 0:
            return t
        key, start, end = _span(t)
        if key in self.skip or key[3] == 0:
            return t
        return _Held(self, t.detach(), key, (start, end), self.call)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _change(self, key, span, by: int):
        spans = self.spans.setdefault(key, {})
        spans[span] = spans.get(span, 0) + by
        if spans[span] == 0:
            del spans[span]
        covered = _union(spans)
        self.bytes += covered - self.covered.get(key, 0)
        self.covered[key] = covered
        if not spans:
            del self.spans[key], self.covered[key]

    def _add(self, key, span, call):
        self._change(key, span, 1)
        self.calls[call] = self.calls.get(call, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_calls = max(self.peak_calls, len(self.calls))

    def _drop(self, key, span, call):
        self._change(key, span, -1)
        self.calls[call] -= 1
        if self.calls[call] == 0:
            del self.calls[call]


class _Held:
    """What autograd stores instead of a saved tensor: the tensor, detached (holding an
    output with its grad_fn would make a reference cycle that outlives a dropped graph),
    so its memory cannot be reused while counted, and where it was counted; dropping it
    uncounts."""
    __slots__ = ("meter", "t", "key", "span", "call")

    def __init__(self, meter, t, key, span, call):
        self.meter, self.t, self.key, self.span, self.call = meter, t, key, span, call
        meter._add(key, span, call)

    def __del__(self):
        self.meter._drop(self.key, self.span, self.call)


def model_state(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers: what an :class:`ActivationMeter` leaves out."""
    return [*module.parameters(), *module.buffers()]


def saved_activation_bytes(fn, *args, exclude: nn.Module | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` (a forward); return (its result, bytes autograd holds for
    its backward once it returns), counted by :class:`ActivationMeter` with ``exclude``'s
    parameters and buffers left out."""
    meter = ActivationMeter(model_state(exclude) if exclude is not None else ())
    with meter.recording():
        result = fn(*args, **kwargs)
    return result, meter.bytes


class Metered(nn.Module):
    """A stage whose saved activations are counted by an :class:`ActivationMeter`."""

    def __init__(self, inner: nn.Module, meter: ActivationMeter):
        super().__init__()
        self.inner, self.meter = inner, meter

    def forward(self, x):
        with self.meter.recording():
            return self.inner(x)
