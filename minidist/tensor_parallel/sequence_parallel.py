"""Megatron sequence parallelism: shard along the sequence what tensor parallelism replicates.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.2.2. Tensor parallelism (Shoeybi et al. 2019) splits attention and the MLP, but
leaves LayerNorm, dropout and the residual adds replicated: every rank stores the same
10·sbh bytes of them (16-bit), which do not shrink with t. Those ops are independent
along the sequence, so each rank can run them on s/t tokens instead. The layout of one
transformer layer (activations are (batch, seq, hidden); ``SEQ_DIM`` = 1):

    x[s/t] -> LayerNorm -> all-gather(seq) -> column-parallel -> ... -> row-parallel
           -> reduce-scatter(seq) -> dropout -> + x[s/t]

The all-reduce of g becomes a reduce-scatter, the identity of f an all-gather, and since
a ring all-reduce *is* a reduce-scatter followed by an all-gather, the bytes on the wire
do not change: forward 2 all-gathers + 2 reduce-scatters per layer instead of 2
all-reduces. Activation memory becomes sbh/t·(34 + 5as/h) (16-bit; see
:mod:`minidist.cost.tensor_parallel`) on one condition: the column-parallel layer must not
keep the *gathered* input for its weight gradient, only its own shard, and all-gather it
again in backward (:class:`SequenceParallelLinear`; Megatron overlaps that re-gather with
the input-gradient matmul). Backward per layer is then 4 all-gathers + 2 reduce-scatters.

The price: parameters that act on a sequence shard (LayerNorm weight and bias, a
row-parallel bias added after the reduce-scatter, a position embedding added to a shard)
see only s/t tokens on each rank, so their gradients are partial sums; the full
gradient is their all-reduce over the tensor-parallel group. Modules mark such
parameters with :func:`mark_sequence_parallel`; call :func:`sync_sequence_parallel_grads`
after backward (one coalesced all-reduce), before the optimizer step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist.collectives.p2p import group_info
from minidist.tensor_parallel.comm import _all_gather, _reduce_scatter, gather_from_tp, split_along_dim

__all__ = ["SEQ_DIM", "SequenceParallelLinear", "sequence_parallel_linear", "scatter_to_sequence",
           "gather_from_sequence", "mark_sequence_parallel", "sequence_parallel_params",
           "sync_sequence_parallel_grads"]

SEQ_DIM = 1     # activations are (batch, seq, hidden), as in minidist.models.TinyGPT


class SequenceParallelLinear(torch.autograd.Function):
    """y = all_gather(x_shard) Wᵀ + b, keeping only ``x_shard`` for backward.

    Backward all-gathers the input again (for dW) and reduce-scatters dx, so a rank holds
    1/t of the input between forward and backward: that is the whole memory win of SP.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, dim, group):
        ctx.dim, ctx.group, ctx.has_bias = dim, group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(_all_gather(x_shard, dim, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _reduce_scatter(grad @ weight, ctx.dim, ctx.group)
        if ctx.needs_input_grad[1]:
            total = _all_gather(x_shard, ctx.dim, ctx.group)       # the re-gather
            grad_w = grad.flatten(0, -2).T @ total.flatten(0, -2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.flatten(0, -2).sum(0)
        return grad_x, grad_w, grad_b, None, None


def sequence_parallel_linear(x_shard, weight, bias=None, group=None, dim: int = SEQ_DIM):
    """The column-parallel matmul of a sequence-parallel layer (input sharded along ``dim``)."""
    if group_info(group)[1] == 1:
        return F.linear(x_shard, weight, bias)
    return SequenceParallelLinear.apply(x_shard, weight, bias, dim % x_shard.dim(), group)


def scatter_to_sequence(x, group=None):
    """Replicated (b, s, h) -> this rank's (b, s/t, h); backward all-gathers."""
    _check_seq(x, group)
    return split_along_dim(x, SEQ_DIM, group)


def gather_from_sequence(x, group=None):
    """This rank's (b, s/t, h) -> replicated (b, s, h), for a replicated consumer."""
    return gather_from_tp(x, SEQ_DIM, group)


def _check_seq(x, group):
    t = group_info(group)[1]
    if x.shape[SEQ_DIM] % t:
        raise ValueError(f"sequence parallelism needs the sequence length ({x.shape[SEQ_DIM]}) to be "
                         f"divisible by the tensor-parallel size ({t})")


# ----------------------------------------------------------------------------- partial gradients
def mark_sequence_parallel(*params: nn.Parameter) -> None:
    """Mark parameters whose gradient is a per-rank partial sum under SP."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """All-reduce (sum) the gradients of the marked parameters over the TP group, in one
    flat buffer. Call after backward, before the optimizer; returns the bytes reduced."""
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if not grads or group_info(group)[1] == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()
