"""ZeRO stages 1 and 2: shard the optimizer states, then the gradients, across N ranks.

Rajbhandari, Rasley, Ruwase, He 2019, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (SC'20). Data parallelism keeps N identical copies of the
*model states*: parameters, gradients and Adam's two moments. But Adam is elementwise,
so rank r only needs the states of the 1/N of the elements it updates:

* **Stage 1** (P_os): each rank keeps Adam states for its shard only. After backward the
  full gradient is reduce-scattered (each rank receives the average of its shard), the
  rank updates its shard of the parameters, and an all-gather rebuilds the full
  parameters everywhere. Memory (4+4+8/N)Ψ bytes in fp32.
* **Stage 2** (P_os+g): as stage 1, but each gradient bucket is reduce-scattered from
  the backward hooks as soon as it is complete, and the full gradient is dropped, so only
  the 1/N gradient shard survives backward. Memory (4+(4+8)/N)Ψ.

Communication equals DDP's: reduce-scatter + all-gather = 2·(N−1)/N·Ψ per rank, the
same as one all-reduce (which *is* a reduce-scatter followed by an all-gather).

Shards are flat and padded (:class:`~minidist.data_parallel.common.FlatShard`), so any parameter count works. Frozen
parameters are left alone (replicated, no gradient, no optimizer state). Stage 3 (the
parameters sharded too) is in :mod:`minidist.data_parallel.fsdp`.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

# torch 2.13 renames these two to *_single; minidist.trace records the old names, so keep them.
warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")

from minidist.collectives.p2p import group_info
from minidist.data_parallel.common import (FlatShard, GradSyncWrapper, at_end_of_backward, broadcast_module,
                                           make_buckets, trainable_parameters)
from minidist.data_parallel.shard_ops import accumulate_shard_grad, step_and_gather


class _ShardedBucket:
    """A bucket of replicated parameters stored in one flat buffer, plus this rank's shard."""

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int):
        self.params = params
        self.layout = FlatShard([p.shape for p in params], world_size, rank)
        self.flat = self.layout.flatten([p.detach() for p in params])
        with torch.no_grad():
            for p, view in zip(params, self.layout.views(self.flat)):
                p.data = view           # the module now reads its weights from the flat buffer
        # A view with no autograd history is a leaf, so the optimizer accepts it; updating
        # it in place updates our slice of the flat buffer, i.e. of the module's weights.
        self.shard = self.layout.my_shard(self.flat)
        self.reset()

    def reset(self):
        self.ready: set[int] = set()
        self.grad_flat = None           # stage 2: full gradient, alive only until reduced
        self.reduced = None             # stage 2: this rank's summed gradient shard
        self.work = None


class ZeroDataParallel(GradSyncWrapper):
    """ZeRO stage 1 or 2 around a module, owning its (sharded) optimizer.

    Usage: ``loss = zero(x); loss.backward(); zero.step(); zero.zero_grad()``.
    ``optimizer_cls`` must be elementwise (Adam, AdamW, SGD): it only ever sees this
    rank's flat shard. Gradient accumulation: stage 1 accumulates locally anyway; for
    stage 2 either reduce every micro-step (the shard accumulates) or wrap the earlier
    micro-steps in :meth:`no_sync` (the full gradient accumulates, then is reduced once).
    """

    def __init__(self, module: nn.Module, stage: int = 1, optimizer_cls=torch.optim.Adam,
                 group=None, bucket_cap_bytes: int = 1 << 20, broadcast_from: int | None = 0,
                 **optimizer_kwargs):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got stage={stage!r} "
                             "(stage 3 is minidist.data_parallel.fsdp.FullyShardedDataParallel)")
        self.module, self.group, self.stage = module, group, stage
        self.rank, self.world_size = group_info(group)
        params = trainable_parameters(module)
        groups = make_buckets(params, bucket_cap_bytes)   # validates before any collective
        if broadcast_from is not None:
            broadcast_module(module, broadcast_from, group)
        self.buckets = [_ShardedBucket(ps, self.world_size, self.rank) for ps in groups]
        self.optimizer = optimizer_cls([b.shard for b in self.buckets], **optimizer_kwargs)
        if stage == 1:
            # Stage 1 keeps the full gradient anyway: keep it as one flat buffer per bucket,
            # with every .grad a view into it, so backward accumulates in place and the
            # reduce-scatter reads it directly instead of from a Ψ-sized copy.
            for b in self.buckets:
                b.full_grad = torch.zeros_like(b.flat)
                b.grad_views = b.layout.views(b.full_grad)
            self.zero_grad()
        self._sync, self._next, self._in_backward = True, 0, False
        if stage == 2:
            self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # -- stage 2: reduce-scatter from the hooks ---------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            at_end_of_backward(self._finish_backward)
        bucket, i = self._where[id(p)]
        bucket.ready.add(i)
        self._launch_ready_buckets()

    def _launch(self, b: _ShardedBucket) -> None:
        b.grad_flat = b.layout.flatten([p.grad for p in b.params], like=b.flat)
        for p in b.params:
            p.grad = None               # the point of stage 2: the full gradient dies here
        b.reduced = torch.empty_like(b.shard)
        b.work = dist.reduce_scatter_tensor(b.reduced, b.grad_flat, group=self.group, async_op=True)

    def _launch_ready_buckets(self) -> None:
        # In order, as in BucketedDDP: collectives must be issued identically on all ranks.
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            if self._next >= 2:
                # At most two buckets in flight: the full gradient copies we wait for here
                # would otherwise all live until the end of backward, i.e. Ψ again.
                self._retire(self.buckets[self._next - 2])
            self._next += 1

    def _retire(self, b: _ShardedBucket) -> None:
        if b.work is not None:
            b.work.wait()
            accumulate_shard_grad(b.shard, b.reduced, self.group)
            b.work = b.grad_flat = b.reduced = None

    def _finish_backward(self) -> None:
        for b in self.buckets[self._next:]:   # unused parameters: their hooks never fired
            b.ready.update(range(len(b.params)))
        self._launch_ready_buckets()
        for b in self.buckets:
            self._retire(b)
            b.reset()
        self._next, self._in_backward = 0, False

    # -- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """(stage 1: reduce-scatter gradients) → update own shard → all-gather parameters."""
        if self.stage == 1:
            for b in self.buckets:
                for p, view in zip(b.params, b.grad_views):
                    if p.grad is None:                   # unused this step: zero gradient
                        view.zero_()
                    elif p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)               # someone replaced .grad: take it back
                    p.grad = view
                summed = torch.empty_like(b.shard)
                dist.reduce_scatter_tensor(summed, b.full_grad, group=self.group)
                accumulate_shard_grad(b.shard, summed, self.group)
        step_and_gather(self.optimizer, [(b.flat, b.shard) for b in self.buckets], self.group)
        if self.stage == 1:
            for b in self.buckets:
                b.shard.grad = None   # stage 1 keeps full gradients; the shard was scratch

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.shard.grad = None
            if self.stage == 1:
                b.full_grad.zero_()
                for p, view in zip(b.params, b.grad_views):
                    p.grad = view
            else:
                for p in b.params:
                    p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Every parameter-like tensor this wrapper holds (for memory accounting)."""
        return list(self.module.parameters()) + [b.shard for b in self.buckets]
