"""Matmul + reduce-scatter as a ring: sequence parallelism's row-parallel linear with its scatter hidden.

The row-parallel linear that closes an MLP or attention block under sequence parallelism
(Korthikanti et al. 2022) computes a partial product over this rank's input features and
reduce-scatters it along the sequence: y_shard = reduce_scatter(x Wᵀ). Plain, the whole
partial product is computed first and the reduce-scatter blocks after it
(:func:`minidist.tensor_parallel.reduce_scatter_along_dim` of ``F.linear(x, W)``). Decomposed
(Wang et al. 2023, :mod:`minidist.overlap.ring`), each rank computes the partial product one
output chunk at a time, the chunk the accumulator travelling the ring needs next, while the
previous accumulator is on the wire:

    forward    y_shard = Σ_ranks x_c Wᵀ for c = my rank, one x_c Wᵀ per ring step  (reduce-scatter ring)
    backward   dx_c = dy_c W and dW += dy_cᵀ x_c for every chunk c, while the next
               dy chunk travels                                                     (all-gather ring)

A bias belongs after the reduce-scatter, on the shard (``y + b``, outside this function), as
in the plain version. Results equal the plain version's up to the order of the sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist.collectives.p2p import group_info
from minidist.overlap.ring import ring_all_gather_consume, ring_reduce_scatter_produce

__all__ = ["MatmulReduceScatter", "matmul_reduce_scatter"]


class MatmulReduceScatter(torch.autograd.Function):
    """y_shard = reduce_scatter(x Wᵀ along ``dim``), decomposed into a ring (see the module)."""

    @staticmethod
    def forward(ctx, x, weight, dim, group):
        t = group_info(group)[1]
        n = x.shape[dim] // t
        ctx.dim, ctx.group, ctx.n = dim, group, n
        ctx.save_for_backward(x, weight)
        return ring_reduce_scatter_produce(lambda c: F.linear(x.narrow(dim, c * n, n), weight), group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dim, n, t = ctx.dim, ctx.n, group_info(ctx.group)[1]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_xs: list = [None] * t
        grad_w = torch.zeros_like(weight) if want_w else None

        def chunk_grads(c, grad_c):       # dy_c arrived (or is mine): its rows of dx, its share of dW
            if want_x:
                grad_xs[c] = grad_c @ weight
            if want_w:
                grad_w.add_(grad_c.flatten(0, -2).T @ x.narrow(dim, c * n, n).flatten(0, -2))

        ring_all_gather_consume(grad, chunk_grads, ctx.group)
        return (torch.cat(grad_xs, dim) if want_x else None), grad_w, None, None


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), dim)``, the scatter hidden behind the matmul.

    ``x``: the whole sequence of this rank's input features (a row-parallel input);
    ``weight``: (out, in / t), this rank's row-parallel shard; the size of ``dim`` must divide by
    the group's size. Returns this rank's chunk along ``dim`` of the sum over ranks. Equals
    ``reduce_scatter_along_dim(F.linear(x, weight), dim, group)`` within fp32 rounding; a group of
    one rank is a plain ``F.linear``."""
    if x.dim() < 2:
        raise ValueError(f"matmul_reduce_scatter needs an input with a scatter dim and a feature dim, got shape "
                         f"{tuple(x.shape)}")
    dim = dim % x.dim()
    if dim == x.dim() - 1:
        raise ValueError("matmul_reduce_scatter scatters along a row dim (e.g. the sequence), not the feature dim")
    t = group_info(group)[1]
    if x.shape[dim] % t:
        raise ValueError(f"matmul_reduce_scatter along dim {dim}: size {x.shape[dim]} is not divisible by {t} ranks")
    if t == 1:
        return F.linear(x, weight)
    return MatmulReduceScatter.apply(x, weight, dim, group)
