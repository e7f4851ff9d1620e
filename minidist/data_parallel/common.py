"""What every data-parallel wrapper shares: which parameters to sync, identical replicas,
the end-of-backward callback, ``no_sync``, gradient buckets and flat padded shards.

Used by :mod:`~minidist.data_parallel.ddp`, :mod:`~minidist.data_parallel.parameter_server`,
:mod:`~minidist.data_parallel.zero` and :mod:`~minidist.data_parallel.fsdp`.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

__all__ = ["trainable_parameters", "broadcast_module", "at_end_of_backward", "GradSyncWrapper",
           "make_buckets", "FlatShard"]


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that need gradient sync: shared (tied) ones once, frozen ones not at all."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no parameter with requires_grad=True: nothing to synchronise")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
    return params


def broadcast_module(module: nn.Module, src: int = 0, group=None) -> None:
    """Make every rank start from rank ``src``'s weights (replicas must be identical)."""
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, group=group, group_src=src)


def at_end_of_backward(callback) -> None:
    """Run ``callback`` when the current backward pass finishes (must be called from a hook).

    This is the autograd engine's own mechanism, the one torch DDP uses to wait for its
    buckets: ``loss.backward()`` then returns with the gradients already synchronised.
    """
    Variable._execution_engine.queue_callback(callback)


class GradSyncWrapper(nn.Module):
    """What every data-parallel wrapper here shares: it runs the wrapped module, and
    ``no_sync()`` turns its gradient communication off for the backward passes inside
    (gradient accumulation: the last micro-step, outside the block, syncs the sum)."""

    _sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


def make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Greedy buckets of at most ``cap_bytes`` (a bigger single tensor gets its own bucket).

    Reverse registration order approximates the order gradients become ready in backward,
    so the first bucket fills first. A dtype change starts a new bucket (one flat buffer).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {cap_bytes}")
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class FlatShard:
    """Tensors laid end to end in one flat vector, padded to a multiple of N.

    With Ψ elements the padded length is N·S with S = ⌈Ψ/N⌉; rank r owns the slice
    [r·S, (r+1)·S). Padding (< N elements) is what makes reduce_scatter_tensor and
    all_gather_into_tensor, which need equal chunks, work for any Ψ.
    """

    def __init__(self, shapes: list[torch.Size], world_size: int, rank: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.world_size, self.rank = world_size, rank
        self.shard_numel = -(-self.numel // world_size)
        self.padded_numel = self.shard_numel * world_size

    def flatten(self, tensors, like: torch.Tensor | None = None) -> torch.Tensor:
        """One padded flat vector; ``None`` entries (no gradient) become zeros."""
        like = like if like is not None else next(t for t in tensors if t is not None)
        flat = torch.zeros(self.padded_numel, dtype=like.dtype, device=like.device)
        for t, view in zip(tensors, self.views(flat)):
            if t is not None:
                view.copy_(t)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the original tensors (writes go through)."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def my_shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
