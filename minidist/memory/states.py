"""Model-state bytes: the storages behind the parameters, gradients and optimizer states a rank holds.

Storages, not ``numel``: a parameter that is a view into a flat buffer costs the whole buffer
(padding included), a tensor whose storage was freed (ZeRO-3 between layers) costs 0, and a
storage shared by several tensors (a shard that is a view of the flat parameter) is counted
once. These are the three categories of the ZeRO paper's formula (Rajbhandari et al. 2019,
``(2 + 2 + K)Ψ`` in mixed precision), set next to :mod:`minidist.cost.data_parallel`.
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

