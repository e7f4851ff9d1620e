"""The tensor-parallel TinyGPT: every piece of this package in one model.

Shoeybi et al. 2019, "Megatron-LM" (Sec. 3, Fig. 3 and 4), with the sequence
parallelism of Korthikanti et al. 2022 (Sec. 4.2.2) as an option. Built from the same
full weights as the single-process :class:`minidist.models.TinyGPT`, it computes the same
loss and (after :meth:`ParallelGPT.sync_grads`) the same gradients, each rank holding:

    tok_emb   VocabParallelEmbedding        rows [V_r]          g (or reduce-scatter, SP)
    pos_emb   replicated                                         (SP: rows of my positions)
    blocks    LayerNorm (replicated / SP shard) -> ParallelAttention (heads a/t)
              LayerNorm                         -> ParallelMLP (hidden d_ff/t)
    ln_f      replicated / SP shard
    lm_head   ColumnParallelLinear               rows [V/t]         f (or all-gather, SP)
    loss      vocab_parallel_cross_entropy       3 all-reduces of (b·s) numbers

Per block: 2 all-reduces forward + 2 backward (t > 1), or with SP 2 all-gathers + 2
reduce-scatters forward and 4 all-gathers + 2 reduce-scatters backward; byte counts in
:mod:`minidist.cost.tensor_parallel`. The logits stay split over the vocabulary: the
(b, s, V) tensor never exists on any rank.

:func:`torch_parallelize` applies the same plan with torch's own tensor parallelism
(DTensor ``parallelize_module``) to a TinyGPT, the comparison the tests and
``minidist bench tensor_parallel`` run.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.tensor_parallel.blocks import ParallelAttention, ParallelDropout, ParallelMLP, RNGTracker
from minidist.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minidist.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from minidist.tensor_parallel.sequence_parallel import mark_sequence_parallel, sync_sequence_parallel_grads

__all__ = ["ParallelBlock", "ParallelGPT", "tensor_parallel_block", "tensor_parallel_gpt", "torch_parallelize",
           "grads_as_params", "max_grad_error"]


def _replica(module: nn.Module, sequence_parallel: bool) -> nn.Module:
    """A replicated copy (LayerNorm, position embedding); under SP it sees a sequence shard."""
    module = copy.deepcopy(module)
    if sequence_parallel:
        mark_sequence_parallel(*module.parameters())
    return module


class ParallelBlock(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), x + mlp(ln_2(x)); x is (b, s, h), or (b, s/t, h) under SP."""

    def __init__(self, ln_1: nn.Module, attn: ParallelAttention, ln_2: nn.Module, mlp: ParallelMLP):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def tensor_parallel_block(block: nn.Module, group=None, *, sequence_parallel: bool = False,
                          rng: RNGTracker | None = None) -> ParallelBlock:
    """This rank's part of a :class:`minidist.models.GPTBlock`. Under SP, call
    :func:`~minidist.tensor_parallel.sync_sequence_parallel_grads` after backward."""
    rng = rng or RNGTracker(group=group)
    kw = dict(sequence_parallel=sequence_parallel, rng=rng)
    return ParallelBlock(_replica(block.ln_1, sequence_parallel), ParallelAttention.from_full(block.attn, group, **kw),
                         _replica(block.ln_2, sequence_parallel), ParallelMLP.from_full(block.mlp, group, **kw))


class ParallelGPT(nn.Module):
    """TinyGPT split over a tensor-parallel group. ``forward(ids)`` -> this rank's logits
    (b, s, V/t); :meth:`loss` -> the replicated mean cross entropy."""

    def __init__(self, model: nn.Module, group=None, *, sequence_parallel: bool = False, seed: int = 0):
        super().__init__()
        cfg = model.cfg
        self.rank, self.t = group_info(group)
        if cfg.vocab % self.t:
            raise ValueError(f"vocab = {cfg.vocab} is not divisible by t = {self.t}: the LM head is column-parallel "
                             f"(Megatron pads the vocabulary to a multiple of t)")
        if sequence_parallel and cfg.seq_len % self.t:
            raise ValueError(f"seq_len = {cfg.seq_len} is not divisible by t = {self.t} (sequence parallelism)")
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        self.rng = RNGTracker(seed, group)
        sp = dict(sequence_parallel=sequence_parallel)
        self.tok_emb = VocabParallelEmbedding.from_full(model.tok_emb, group, **sp)
        self.pos_emb = _replica(model.pos_emb, sequence_parallel)
        self.drop = ParallelDropout(cfg.dropout, self.rng, "parallel" if sequence_parallel else "replicated")
        self.blocks = nn.ModuleList(tensor_parallel_block(b, group, rng=self.rng, **sp) for b in model.blocks)
        self.ln_f = _replica(model.ln_f, sequence_parallel)
        self.lm_head = ColumnParallelLinear.from_full(model.lm_head, group, **sp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    # embed and head are apart so that a pipeline stage (minidist.mesh) can run only its end
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (b, s) -> the blocks' input (b, s, h), or (b, s/t, h) under SP."""
        s = ids.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence of {s} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(ids)       # checks ids (and s % t under SP) before communicating
        if self.sequence_parallel:  # my tokens only: add my positions' rows
            chunk = s // self.t
            x = x + self.pos_emb.weight[self.rank * chunk:(self.rank + 1) * chunk]
        else:
            x = x + self.pos_emb(torch.arange(s, device=ids.device))
        return self.drop(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output -> this rank's logits (b, s, V/t)."""
        return self.lm_head(self.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.group, ignore_index, vocab_size=self.cfg.vocab)

    def sync_grads(self) -> int:
        """After backward: sum the partial gradients of SP-marked parameters (no-op without SP)."""
        return sync_sequence_parallel_grads(self, self.group) if self.sequence_parallel else 0


def tensor_parallel_gpt(model: nn.Module, group=None, *, sequence_parallel: bool = False, seed: int = 0) -> ParallelGPT:
    """This rank's :class:`ParallelGPT` cut from a full :class:`minidist.models.TinyGPT`."""
    return ParallelGPT(model, group, sequence_parallel=sequence_parallel, seed=seed)


# ----------------------------------------------------------------------------- checking against one process
def grads_as_params(module: nn.Module) -> nn.Module:
    """A copy of a single-process ``module`` (after backward) whose parameters hold its
    gradients. Cut it exactly as the TP model was cut (``tensor_parallel_gpt(grads_as_params(
    ref), group)``) and its parameters are the gradients this rank must have."""
    g = copy.deepcopy(module)
    for p, q in zip(g.parameters(), module.parameters()):
        if q.grad is None:
            raise ValueError("the reference has a parameter without gradient: run backward first")
        p.data = q.grad.detach().clone()
    return g


def max_grad_error(ours: nn.Module, expected: nn.Module) -> float:
    """max |grad − expected| over parameters matched by name (e.g. from :func:`grads_as_params`)."""
    worst = 0.0
    for (n, p), (m, q) in zip(ours.named_parameters(), expected.named_parameters(), strict=True):
        if n != m or p.grad is None:
            raise ValueError(f"parameter {n!r} has no gradient or no counterpart ({m!r})")
        worst = max(worst, (p.grad.detach().double() - q.detach().double()).abs().max().item())
    return worst


# ----------------------------------------------------------------------------- torch's own TP
def torch_parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard a TinyGPT in place with ``torch.distributed.tensor.parallel`` (the same split).

    q, k, v, fc and lm_head are ``ColwiseParallel``, o and proj ``RowwiseParallel``, the
    token embedding ``RowwiseParallel`` (vocab-parallel), LayerNorms ``SequenceParallel``
    under SP. The logits come out as a DTensor sharded over the vocabulary: compute the
    loss inside ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    seq = Shard(1)
    out = seq if sequence_parallel else Replicate()
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=out),
            "lm_head": ColwiseParallel(input_layouts=out, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        plan |= {b + "attn.q": ColwiseParallel(), b + "attn.k": ColwiseParallel(), b + "attn.v": ColwiseParallel(),
                 b + "attn.o": RowwiseParallel(output_layouts=out),
                 b + "mlp.fc": ColwiseParallel(), b + "mlp.proj": RowwiseParallel(output_layouts=out)}
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan |= {b + "ln_1": SequenceParallel(), b + "ln_2": SequenceParallel(),
                     b + "attn": gather, b + "mlp": copy.deepcopy(gather)}
    return parallelize_module(model, mesh, plan)
