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
"""
from __future__ import annotations

import torch


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
