"""Vocab-parallel cross entropy: the loss of logits that no rank holds whole.

Shoeybi et al. 2019, "Megatron-LM", Sec. 3 ("output embedding"): after a column-parallel
LM head rank r holds logits z[:, V_r] for its slice V_r of the vocabulary. Gathering
the (tokens × vocab) logits would move b·s·v elements; instead fuse the loss with the
split and move three numbers per token. For token n with target y:

    loss_n = log Σ_v exp(z_v − m) − (z_y − m),     m = max_v z_v   (for stability)

    1. m      = all-reduce MAX of each rank's local max
    2. z_y − m: the one rank owning y contributes it, the others 0 -> all-reduce SUM
    3. Σ exp  = all-reduce SUM of each rank's local sum of exp(z − m)

Backward needs no communication at all: d loss_n / d z_v = softmax_v − [v = y], and each
rank has softmax over its own slice (exp(z − m) / Σ exp, both already global). Targets
equal to ``ignore_index`` contribute 0 and are left out of the mean, like
``F.cross_entropy``. The vocabulary may be split unevenly (``tensor_split`` order: pass
``vocab_size``), and a target on a shard boundary belongs to exactly one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info
from minidist.tensor_parallel.comm import shard_range

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses (tokens,) from this rank's logits (tokens, V_r) starting at id ``start``."""

    @staticmethod
    def forward(ctx, logits, target, start, group, ignore_index):
        _, t = group_info(group)
        logits = logits.detach()
        m = logits.max(dim=-1).values
        if t > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)                      # 1
        shifted = logits - m.unsqueeze(-1)
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + logits.shape[-1])     # is y on this rank?
        idx = (target - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        if t > 1:
            dist.all_reduce(target_logit, group=group)                                 # 2
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if t > 1:
            dist.all_reduce(sum_exp, group=group)                                      # 3
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax.clone()       # keep the saved softmax intact (retain_graph)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, ignore_index: int = -100,
                                 *, vocab_size: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of ``logits`` (..., V_r), this rank's vocabulary slice, against global
    ``target`` ids (...), identical on every rank. ``vocab_size``: the whole vocabulary,
    needed when it is not t·V_r (uneven split); default t·V_r. ``reduction``: "mean" (over
    targets not equal to ``ignore_index``), "sum" or "none"; the result is replicated."""
    rank, t = group_info(group)
    local = logits.shape[-1]
    if vocab_size is None:
        start, vocab = rank * local, t * local
    else:
        (start, stop), vocab = shard_range(vocab_size, rank, t), vocab_size
        if stop - start != local:
            raise ValueError(f"rank {rank} of {t} owns ids [{start}, {stop}) of a {vocab_size}-token vocabulary, "
                             f"but its logits have {local} columns")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: target must be logits' "
                         f"shape without the last (vocabulary) dimension")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        raise ValueError(f"target ids must be in [0, {vocab}) or equal ignore_index={ignore_index}, "
                         f"got {int(target[bad].flatten()[0])}")
    losses = VocabParallelCrossEntropy.apply(logits.reshape(-1, local), target.reshape(-1), start, group,
                                             ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
