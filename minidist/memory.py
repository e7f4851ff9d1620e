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
* :class:`ActivationMeter` — the bytes autograd keeps for backward (saved-tensor hooks),
  per forward call, exactly: what the activation-memory formulas of pipeline and tensor
  parallelism predict.
"""
from __future__ import annotations

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


def _cpu_allocation_deltas(prof) -> list[int]:
    """Signed allocation sizes, in time order, from a profile taken with profile_memory=True."""
    from torch._C._profiler import _EventType
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return [size for _, size in sorted(events, key=lambda e: e[0])]


def peak_bytes(fn, *args, device: torch.device | str = "cpu", **kwargs) -> tuple[object, int, int]:
    """Run ``fn``; return (its result, peak bytes above the level at the start, net change).

    The net change is what ``fn`` left allocated (e.g. gradients created during a step),
    so ``states_after - net + peak`` is the absolute peak when ``states_after`` is what
    the rank holds at the end. On CPU this counts every allocation of this process,
    gloo's threads included.
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
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    live = peak = 0
    for delta in _cpu_allocation_deltas(prof):
        live += delta
        peak = max(peak, live)
    return result, peak, live


# ----------------------------------------------------------------------------- activations
class ActivationMeter:
    """Counts the bytes autograd holds for the micro-batches a stage has run forward on.

    Wrap every stage in :class:`Metered`; each forward call's saved tensors (parameters
    excepted, each storage once) stay counted until autograd releases them, i.e. until the
    backward that consumes them has run (or the graph is dropped)."""

    def __init__(self, params):
        self.param_ptrs = {q.data_ptr() for q in params}
        self.live: dict[tuple, int] = {}     # (data pointer, numel) -> holders alive
        self.sizes: dict[int, int] = {}
        self.calls: dict[int, int] = {}      # forward call -> holders alive
        self.bytes = self.peak_bytes = 0
        self.peak_calls = 0
        self.call = 0

    def pack(self, t):
        ptr = t.data_ptr()
        if ptr in self.param_ptrs or not t.is_floating_point():
            return t
        return _Held(self, t, (ptr, t.numel()), self.call)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _add(self, ptr, nbytes, call):
        if self.live.get(ptr, 0) == 0:
            self.sizes[ptr] = nbytes
            self.bytes += nbytes
        self.live[ptr] = self.live.get(ptr, 0) + 1
        self.calls[call] = self.calls.get(call, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_calls = max(self.peak_calls, len(self.calls))

    def _drop(self, ptr, call):
        self.live[ptr] -= 1
        if self.live[ptr] == 0:
            self.bytes -= self.sizes.pop(ptr)
            del self.live[ptr]
        self.calls[call] -= 1
        if self.calls[call] == 0:
            del self.calls[call]


class _Held:
    __slots__ = ("meter", "t", "ptr", "call")

    def __init__(self, meter, t, ptr, call):
        self.meter, self.t, self.ptr, self.call = meter, t, ptr, call
        meter._add(ptr, t.numel() * t.element_size(), call)

    def __del__(self):
        self.meter._drop(self.ptr, self.call)


class Metered(nn.Module):
    """A stage whose saved activations are counted by an :class:`ActivationMeter`."""

    def __init__(self, inner: nn.Module, meter: ActivationMeter):
        super().__init__()
        self.inner, self.meter = inner, meter

    def forward(self, x):
        self.meter.call += 1
        with torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack):
            return self.inner(x)
