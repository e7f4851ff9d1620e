"""ZeRO in mixed precision: the 2 + 2 + 12 bytes per parameter, sharded stage by stage.

Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20), Sec. 5 and Fig. 1. Mixed-precision Adam holds, per parameter, 2 bytes of
16-bit weight, 2 of 16-bit gradient and K = 12 of fp32 master weight and moments
(:mod:`.mixed_precision`). On N data-parallel ranks, bytes per parameter per rank:

    stage 0 (DDP)     2 + 2 + 12          = 16
    stage 1 (P_os)    2 + 2 + 12/N             fp32 master + moments sharded
    stage 2 (P_os+g)  2 + (2 + 12)/N           + the 16-bit gradient reduce-scattered
    stage 3 (P_os+g+p) (2 + 2 + 12)/N = 16/N   + the 16-bit weights sharded

Nothing new is sharded here: the ZeRO wrappers of :mod:`minidist.data_parallel` shard the
16-bit weights and gradients as they do in fp32 (flat padded shards, so any parameter count
works), and own a :class:`~minidist.memory_techniques.mixed_precision.MixedPrecisionOptimizer`
over their shards, which makes the fp32 masters and moments of exactly those shards. With a
loss scaler, the overflow check agrees across the group with one all-reduce: under ZeRO a
rank sees only its shard of the reduced gradient, so an inf can reach only one rank.

API:
    zero = ZeroMixedPrecision(to_low_precision(model, torch.bfloat16), stage=2, group=g, lr=1e-3,
                              scaler=None)          # stages 0..3; **kwargs go to Adam
    loss = zero(x) ...; zero.scale(loss).backward(); stepped = zero.step(); zero.zero_grad()
    zero.state_bytes()       # {"params", "grads", "optimizer", "total"}: measured storages

    # the functional stage 1 that lab 8 asks for (one flat padded shard per rank):
    master = make_master_shard(model, group)               # fp32 leaf: this rank's slice
    opt = torch.optim.Adam([master], lr=...)
    stepped = zero1_mixed_precision_step(model, master, opt, scaler, group)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.data_parallel import BucketedDDP, FlatShard, FullyShardedDataParallel, ZeroDataParallel
from minidist.data_parallel.common import trainable_parameters
from minidist.memory import storage_bytes
from minidist.memory_techniques.loss_scaler import DynamicLossScaler
from minidist.memory_techniques.mixed_precision import LOW_PRECISION, MixedPrecisionOptimizer

__all__ = ["ZeroMixedPrecision", "make_master_shard", "zero1_mixed_precision_step"]


class ZeroMixedPrecision(nn.Module):
    """A 16-bit module trained with fp32 masters and Adam under ZeRO ``stage`` (0 = DDP) on ``group``.

    Stages 1 and 2 are :class:`~minidist.data_parallel.ZeroDataParallel`, stage 3
    :class:`~minidist.data_parallel.FullyShardedDataParallel` (``wrap``: its units), stage 0
    :class:`~minidist.data_parallel.BucketedDDP` with the optimizer over all parameters; each
    owns a :class:`MixedPrecisionOptimizer` (``optimizer_cls``, ``scaler``, ``**optimizer_kwargs``).
    Call :meth:`state_bytes` after backward to read what the formula counts.
    """

    def __init__(self, module: nn.Module, stage: int = 1, *, group=None, scaler: DynamicLossScaler | None = None,
                 optimizer_cls=torch.optim.Adam, bucket_cap_bytes: int = 1 << 20, wrap=(nn.Linear,),
                 **optimizer_kwargs):
        super().__init__()
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
        params = trainable_parameters(module)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not dtypes <= set(LOW_PRECISION):
            raise ValueError(f"the module's trainable parameters must all be float16 or all bfloat16, found "
                             f"{sorted(map(str, dtypes))} (minidist.memory_techniques.to_low_precision)")
        self.stage, self.group, self.scaler = stage, group, scaler
        opt = dict(inner_optimizer=optimizer_cls, scaler=scaler, **optimizer_kwargs)
        if stage == 0:
            self.wrapper = BucketedDDP(module, group=group, bucket_cap_bytes=bucket_cap_bytes)
            self.optimizer = MixedPrecisionOptimizer(params, **opt)
        elif stage in (1, 2):
            self.wrapper = ZeroDataParallel(module, stage=stage, optimizer_cls=MixedPrecisionOptimizer, group=group,
                                            bucket_cap_bytes=bucket_cap_bytes, **opt)
            self.optimizer = self.wrapper.optimizer
        else:
            self.wrapper = FullyShardedDataParallel(module, wrap=wrap, optimizer_cls=MixedPrecisionOptimizer,
                                                    group=group, **opt)
            self.optimizer = self.wrapper.optimizer
        self.module = module

    def forward(self, *args, **kwargs):
        return self.wrapper(*args, **kwargs)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: scaled when there is a scaler."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step(self) -> bool:
        """Reduce (stage 0/1; stage 2/3 reduced during backward), step the fp32 masters of this
        rank's shard, copy back, re-gather (stage 1/2). False when the step was skipped."""
        if self.stage == 0:
            self.optimizer.step()
        else:
            self.wrapper.step()
        return self.optimizer.last_step_taken

    def zero_grad(self) -> None:
        if self.stage == 0:
            for p in self.optimizer.params:
                p.grad = None
        else:
            self.wrapper.zero_grad()

    def low_precision_tensors(self) -> list[torch.Tensor]:
        """Every 16-bit parameter-like tensor this rank holds (module parameters and shards)."""
        if self.stage == 0:
            return list(self.module.parameters())
        return self.wrapper.state_tensors()

    def state_bytes(self) -> dict[str, int]:
        """Storage bytes held now: {"params" (16-bit), "grads" (16-bit, and fp32 master gradients
        if any), "optimizer" (fp32 masters + moments), "total"}; each storage once."""
        low = self.low_precision_tensors()
        seen: set = set()
        out = {"params": storage_bytes(low, seen),
               "grads": storage_bytes([t.grad for t in low + self.optimizer.masters if t.grad is not None], seen),
               "optimizer": storage_bytes(self.optimizer.state_tensors(), seen)}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    @torch.no_grad()
    def full_masters(self) -> list[torch.Tensor]:
        """The fp32 master of every trainable parameter, whole, in the module's order (stages 1-3:
        an all-gather of each shard over the group, all ranks together): for checks and checkpoints."""
        if self.stage == 0:
            return [m.detach().clone() for m in self.optimizer.masters]
        pieces = self.wrapper.buckets if self.stage in (1, 2) else self.wrapper.units
        whole = {}
        for piece, master in zip(pieces, self.optimizer.masters):
            flat = torch.empty(piece.layout.padded_numel, dtype=master.dtype, device=master.device)
            dist.all_gather_into_tensor(flat, master.detach(), group=self.group)
            for p, view in zip(piece.params, piece.layout.views(flat)):
                whole[id(p)] = view.clone()
        return [whole[id(p)] for p in trainable_parameters(self.module)]


# ----------------------------------------------------------------------------- functional stage 1
def _layout(params, group) -> FlatShard:
    rank, n = group_info(group)
    return FlatShard([p.shape for p in params], n, rank)


def make_master_shard(model: nn.Module, group=None) -> torch.Tensor:
    """This rank's slice of the fp32 flat copy of the model's trainable parameters (padded to a
    multiple of N elements), a leaf on their device: what ZeRO-1's optimizer steps."""
    params = trainable_parameters(model)
    layout = _layout(params, group)
    flat = layout.flatten([p.detach().to(torch.float32) for p in params])
    return layout.my_shard(flat).clone().requires_grad_(True)


@torch.no_grad()
def zero1_mixed_precision_step(model: nn.Module, master_shard: torch.Tensor, optimizer: torch.optim.Optimizer,
                               scaler: DynamicLossScaler | None = None, group=None) -> bool:
    """ZeRO-1 step in mixed precision, all ranks of ``group`` together:

    reduce-scatter the flat 16-bit gradient (each rank receives the sum of its shard), its
    fp32 mean becomes ``master_shard.grad``; with a ``scaler``, unscale and agree on overflow
    (one all-reduce) and skip together; ``optimizer.step()`` on the fp32 shard; all-gather the
    16-bit shards into the model's weights. The model's gradients are dropped. Returns whether
    the step was taken."""
    params = trainable_parameters(model)
    layout = _layout(params, group)
    low = params[0].dtype
    if low not in LOW_PRECISION:
        raise ValueError(f"the model's parameters are {low}: convert it with to_low_precision first")
    if master_shard.dtype != torch.float32 or master_shard.numel() != layout.shard_numel:
        raise ValueError(f"master_shard must be fp32 with {layout.shard_numel} elements (make_master_shard), "
                         f"got {master_shard.dtype} with {master_shard.numel()}")
    n = layout.world_size
    flat_grad = layout.flatten([p.grad for p in params], like=params[0])
    mine = torch.empty(layout.shard_numel, dtype=low, device=flat_grad.device)
    dist.reduce_scatter_tensor(mine, flat_grad, group=group)
    del flat_grad
    for p in params:
        p.grad = None
    master_shard.grad = mine.to(torch.float32).div_(n)
    found_inf = False
    if scaler is not None:
        found_inf = scaler.unscale_([master_shard])
        scaler.update(found_inf)
    if not found_inf:
        optimizer.step()
        flat = torch.empty(layout.padded_numel, dtype=low, device=master_shard.device)
        dist.all_gather_into_tensor(flat, master_shard.detach().to(low), group=group)
        for p, view in zip(params, layout.views(flat)):
            p.copy_(view)
    master_shard.grad = None
    return not found_inf
