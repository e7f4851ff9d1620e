"""The differentiable all-to-all: one sharded dim traded for another.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models", Sec. 3.1. Rank r holds ``x`` cut along
``gather_dim`` (its shard r). Cut ``x`` into P chunks along ``scatter_dim``, send chunk j
to rank j, and concatenate what arrives along ``gather_dim`` in rank order: now rank r
holds chunk r of ``scatter_dim`` and *all* of ``gather_dim``. For Ulysses that is
(b, s/P, h, d) → (b, s, h/P, d) with scatter heads, gather sequence.

Each rank sends (P−1)/P of its tensor and keeps 1/P: the same bytes whatever P, which is
why Ulysses' traffic per rank does not grow with the number of ranks.

Backward: the gradient of a permutation of data across ranks is the inverse
permutation, the all-to-all with the two dims swapped.

Built on ``torch.distributed.all_to_all_single`` (CPU gloo and NCCL; chunk i of its input
goes to group rank i). A group of one rank is the identity and sends nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info

__all__ = ["AllToAll", "all_to_all"]


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    _, p = group_info(group)
    send = torch.stack(x.chunk(p, scatter_dim)).contiguous()     # (P, ...): chunk j for rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)             # rank j's piece at place j


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Scatter ``scatter_dim`` over the group, gather ``gather_dim`` from it (differentiable).

    ValueError (before any message) unless ``x.shape[scatter_dim]`` is divisible by the
    group size and the two dims differ."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"all_to_all needs a tensor, got {type(x).__name__}")
    _, p = group_info(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if scatter_dim == gather_dim:
        raise ValueError(f"scatter_dim and gather_dim are both {scatter_dim}: nothing to trade")
    if x.shape[scatter_dim] % p:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not split "
                         f"into {p} equal chunks")
    return x if p == 1 else AllToAll.apply(x, scatter_dim, gather_dim, group)
