"""Operations on one flat, padded, sharded parameter vector (ZeRO, Rajbhandari et al. 2019).

A group of parameters (a ZeRO bucket, an FSDP unit) lives in one flat vector padded to N·S
elements (:class:`~minidist.data_parallel.common.FlatShard`); rank r owns the slice
[r·S, (r+1)·S), its *shard*, the only part its optimizer sees. What ZeRO does to such a vector:

* :func:`reduce_scatter_grads`: the parameters' gradients, flattened, reduce-scattered; the shard's
  gradient becomes (accumulates) the average over ranks of this rank's slice; the full gradients
  are dropped (ZeRO-2's memory saving);
* :func:`gather_shards`: every rank's shard all-gathered into the flat vector;
* :func:`gather_flat` / :func:`free_flat`: ZeRO-3's flat vector given its storage back and filled,
  then its storage released (the parameters stay views of it);
* :func:`step_and_gather`: the sharded optimizer step, then every flat vector rebuilt, one at a time.

:mod:`~minidist.data_parallel.zero` and :mod:`~minidist.data_parallel.fsdp` are built on them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info
from minidist.data_parallel.common import FlatShard


def accumulate_shard_grad(shard: torch.Tensor, summed: torch.Tensor, group=None) -> None:
    """``shard.grad += summed / N`` (set when there is none): ``summed`` is this rank's slice of the
    sum over the group's N ranks, so the shard's gradient is the average, accumulated over micro-batches."""
    summed.div_(group_info(group)[1])
    if shard.grad is None:
        shard.grad = summed
    else:
        shard.grad += summed


def reduce_scatter_grads(params: list, layout: FlatShard, shard: torch.Tensor, group=None) -> None:
    """``shard.grad +=`` the average over ranks of this rank's slice of ``params``' flat, padded
    gradient (a missing gradient counts as zeros at its place); every ``p.grad`` is dropped. One
    synchronous reduce_scatter_tensor of the whole padded vector."""
    flat_grad = layout.flatten([p.grad for p in params], like=shard)
    summed = torch.empty_like(shard)                     # never the shard: it may be a view of the parameters
    dist.reduce_scatter_tensor(summed, flat_grad, group=group)
    for p in params:
        p.grad = None                                    # the full gradient dies here
    accumulate_shard_grad(shard, summed, group)


def gather_shards(flat: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """All-gather every rank's shard into ``flat``; the work handle when ``async_op``. A shard that is
    a view of ``flat`` (ZeRO-1/2) is sent as a copy: a collective's input must not alias its output."""
    mine = shard.detach()
    if mine.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
        mine = mine.clone()
    return dist.all_gather_into_tensor(flat, mine, group=group, async_op=async_op)


def gather_flat(flat: torch.Tensor, shard: torch.Tensor, nbytes: int, group=None, async_op: bool = False):
    """ZeRO-3: give ``flat``'s storage its ``nbytes`` back and all-gather the shards into it (the
    parameters, views of that storage, see the values again); the work handle when ``async_op``."""
    flat.untyped_storage().resize_(nbytes)
    return gather_shards(flat, shard, group, async_op)


def free_flat(flat: torch.Tensor) -> None:
    """ZeRO-3: release ``flat``'s storage (0 bytes). Its views (the parameters, what autograd saved for
    backward) stay valid objects; the shard, a separate tensor, is kept."""
    flat.untyped_storage().resize_(0)


def step_and_gather(optimizer: torch.optim.Optimizer, pieces, group=None) -> None:
    """ZeRO-1/2's step: ``optimizer`` (built over the shards) updates this rank's shards, then each
    ``(flat, shard)`` of ``pieces`` is all-gathered, one at a time (never a second copy of the model)."""
    optimizer.step()
    for flat, shard in pieces:
        gather_shards(flat, shard, group)
