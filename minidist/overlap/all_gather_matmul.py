"""All-gather + matmul as a ring: sequence parallelism's column-parallel linear with its gather hidden.

Under sequence parallelism (Korthikanti et al. 2022) the column-parallel linear that opens an
MLP or attention block needs the whole sequence, y = all_gather(x_shard) Wᵀ + b, and its
backward needs it again for dW (:class:`minidist.tensor_parallel.sequence_parallel.SequenceParallelLinear`,
the plain version: the gather blocks, then the matmul runs). Here (Wang et al. 2023) every
piece is computed from the chunk at hand while the next one travels
(:mod:`minidist.overlap.ring`):

    forward    y_c  = x_c Wᵀ + b for every chunk c, while x_(c-1) travels          (all-gather ring)
    backward   dW   = Σ_c dy_cᵀ x_c, while x_(c-1) travels                         (all-gather ring again)
               dx   = this rank's chunk of Σ_ranks dy W, one chunk's dy_c W while the
                      accumulator of the previous chunk travels                     (reduce-scatter ring)
               db   = Σ dy over every row (dy is whole here, nothing to exchange)

As the plain version it keeps only ``x_shard`` for backward (1/t of the input). Results equal
the plain version's up to the order of the sums (fp32: ~1e-6): each output chunk is the same
matmul of the same rows, dW and dx add the same terms chunk by chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist.collectives.p2p import group_info
from minidist.overlap.ring import ring_all_gather_consume, ring_reduce_scatter_produce

__all__ = ["AllGatherMatmul", "all_gather_matmul"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(0, -2)


class AllGatherMatmul(torch.autograd.Function):
    """y = all_gather(x_shard along ``dim``) Wᵀ + b, decomposed into a ring (see the module)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, dim, group):
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        t, n = group_info(group)[1], x_shard.shape[dim]
        y = x_shard.new_empty((*x_shard.shape[:dim], t * n, *x_shard.shape[dim + 1:-1], weight.shape[0]))

        def matmul(c, x_c):
            into = y.narrow(dim, c * n, n)
            if into.is_contiguous():            # (chunks along the first dim that is not 1): no copy
                rows = x_c.reshape(-1, x_c.shape[-1])
                if bias is None:
                    torch.mm(rows, weight.t(), out=into.view(-1, into.shape[-1]))
                else:
                    torch.addmm(bias, rows, weight.t(), out=into.view(-1, into.shape[-1]))
            else:
                into.copy_(F.linear(x_c, weight, bias))

        ring_all_gather_consume(x_shard, matmul, group)
        return y

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        n, dim = x_shard.shape[ctx.dim], ctx.dim
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros_like(weight)

            def weight_grad(c, x_c):          # dW += dy_cᵀ x_c, while the next x chunk travels
                grad_w.add_(_rows(grad.narrow(dim, c * n, n)).T @ _rows(x_c))

            ring_all_gather_consume(x_shard, weight_grad, ctx.group)
        if ctx.needs_input_grad[0]:
            grad_x = ring_reduce_scatter_produce(lambda c: grad.narrow(dim, c * n, n) @ weight, ctx.group)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _rows(grad).sum(0)
        return grad_x, grad_w, grad_b, None, None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None,
                      dim: int = 1) -> torch.Tensor:
    """``F.linear(all_gather(x_shard, dim), weight, bias)``, the gather hidden behind the matmul.

    ``x_shard``: this rank's chunk of the input along ``dim`` (every rank's the same shape; chunk
    i is group rank i's); ``weight``: (out, in), this rank's column-parallel shard. Equals
    :func:`minidist.tensor_parallel.sequence_parallel_linear` (forward and gradients) within
    fp32 rounding; a group of one rank is a plain ``F.linear``."""
    if x_shard.dim() < 2:
        raise ValueError(f"all_gather_matmul needs an input with a gather dim and a feature dim, got shape "
                         f"{tuple(x_shard.shape)}")
    dim = dim % x_shard.dim()
    if dim == x_shard.dim() - 1:
        raise ValueError("all_gather_matmul gathers along a row dim (e.g. the sequence), not the feature dim")
    if group_info(group)[1] == 1:
        return F.linear(x_shard, weight, bias)
    return AllGatherMatmul.apply(x_shard, weight, bias, dim, group)
