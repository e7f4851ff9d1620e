"""Ring attention: queries stay, key/value blocks travel round the ring.

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
Sec. 3 and Alg. 1. Rank r holds its sequence shard of q, k, v, (b, s/P, h, d). In step
i = 0..P−1 it attends its queries to the key/value block of rank (r − i) mod P and merges
the partial result into its running (out, lse) through the log-sum-exp
(:func:`~minidist.context_parallel.merge.merge_partial_attention`), while it already
sends that block to rank r+1 and receives the next one from rank r−1: P−1 block passes
forward, each hidden behind one block of compute when compute is the longer of the two
(Sec. 3: block size ≥ FLOPs/bandwidth). No rank ever holds more than two K/V blocks.

Backward (an ``autograd.Function``; Liu et al. Sec. 3, FlashAttention Alg. 4): saved are
only q, k, v, the final out and lse. The K/V blocks go round once more and every rank
recomputes each block's probabilities from the final lse, adding its part to its own dq
and to the dK/dV of the visiting block. The dK/dV accumulators travel *with* their block,
one hop behind it, and a final hop brings each back to its owner: P−1 K/V passes and P
dK/dV passes per rank (``minidist.cost.ring_attention_messages``).

Causal (``causal=True``): block masks come from global positions
(:func:`~minidist.context_parallel.kernel.visible_window`): the own block is triangular,
blocks of earlier tokens are full, of later tokens skipped (they still pass through).
With ``zigzag=True`` the shards are :mod:`~minidist.context_parallel.zigzag`'s and every
rank does the same work. GQA/MQA: only the h_kv heads travel, h/h_kv times fewer bytes.

Messages: one isend to the next rank and one irecv from the previous per pass, posted in
``minidist.collectives.p2p.post_exchange``'s order (deadlock-free even if every op blocks
until matched, as NCCL's may) and waited for after the block's compute (``overlap=True``)
or before it (``overlap=False``, to measure what overlap buys).
"""
from __future__ import annotations

import math

import torch

from minidist.collectives.p2p import group_info, post_exchange, wait_all
from minidist.context_parallel.kernel import acc_dtype, block_backward, block_forward, check_qkv, visible_window
from minidist.context_parallel.merge import merge_partial_attention
from minidist.context_parallel.zigzag import shard_positions

__all__ = ["RingAttention", "ring_attention"]


def _pass(send, group, overlap):
    """Post this step's send to r+1 and receive from r−1; the works, or [] once waited."""
    rank, p = group_info(group)
    incoming = torch.empty_like(send)
    works = post_exchange(send, (rank + 1) % p, incoming, (rank - 1) % p, group)
    if not overlap:
        wait_all(works)
        works = []
    return incoming, works


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, zigzag, overlap, group):
        rank, p = group_info(group)
        acc = acc_dtype(q.dtype)
        qh = q.transpose(1, 2).to(acc)                          # (b, h, s/P, d)
        kv = torch.stack([k, v]).transpose(2, 3).contiguous()   # (2, b, h_kv, s/P, d), travels in q's dtype
        seq = q.size(1) * p
        q_pos = shard_positions(seq, rank, p, zigzag, device="cpu")     # control data (see kernel)
        out = lse = None
        for i in range(p):
            src = (rank - i) % p
            incoming, works = _pass(kv, group, overlap) if i < p - 1 else (None, [])
            k_pos = shard_positions(seq, src, p, zigzag, device="cpu")
            window = visible_window(q_pos, k_pos, causal)
            if window is not None:
                row0, col1, masked = window
                kb, vb = kv[0, :, :, :col1].to(acc), kv[1, :, :, :col1].to(acc)
                out_b, lse_b = block_forward(qh[:, :, row0:], kb, vb, scale, q_pos[row0:], k_pos[:col1], masked)
                if out is None:          # step 0, the own block: every query sees at least itself
                    out, lse = out_b, lse_b
                else:
                    out[:, :, row0:], lse[:, :, row0:] = merge_partial_attention(
                        out[:, :, row0:], lse[:, :, row0:], out_b, lse_b)
            wait_all(works)
            kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, zigzag, overlap, group)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype).transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, zigzag, overlap, group = ctx.args
        rank, p = group_info(group)
        acc = out.dtype
        qh = q.transpose(1, 2).to(acc)
        dout = dout.transpose(1, 2).to(acc)
        delta = (dout * out).sum(-1)                            # D_i = Σ_k dO_ik O_ik
        kv = torch.stack([k, v]).transpose(2, 3).contiguous()
        dq = torch.zeros_like(qh)
        dkv = kv.new_zeros(kv.shape, dtype=acc)                 # the visiting block's dK, dV
        seq = q.size(1) * p
        q_pos = shard_positions(seq, rank, p, zigzag, device="cpu")
        for i in range(p):
            src = (rank - i) % p
            incoming, works = _pass(kv, group, overlap) if i < p - 1 else (None, [])
            k_pos = shard_positions(seq, src, p, zigzag, device="cpu")
            window = visible_window(q_pos, k_pos, causal)
            if window is not None:
                row0, col1, masked = window
                kb, vb = kv[0, :, :, :col1].to(acc), kv[1, :, :, :col1].to(acc)
                dq_b, dk_b, dv_b = block_backward(qh[:, :, row0:], kb, vb, dout[:, :, row0:], delta[:, :, row0:],
                                                  lse[:, :, row0:], scale, q_pos[row0:], k_pos[:col1], masked)
                dq[:, :, row0:] += dq_b
                dkv[0, :, :, :col1] += dk_b
                dkv[1, :, :, :col1] += dv_b
            wait_all(works)
            kv = incoming
            if p > 1:      # the block moves on to r+1, its gradient with it (the last hop: home)
                dkv, _ = _pass(dkv, group, overlap=False)
        dk, dv = dkv.to(q.dtype).transpose(2, 3).unbind(0)
        return dq.to(q.dtype).transpose(1, 2), dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, group=None,
                   zigzag: bool = False, scale: float | None = None, overlap: bool = True,
                   return_lse: bool = False):
    """Attention on sequence shards (b, s/P, h, d) → this rank's output shard (b, s/P, h, d).

    Shards are contiguous (rank r holds chunk r of P) or, with ``zigzag``, chunks r and
    2P−1−r of 2P (:func:`~minidist.context_parallel.zigzag.zigzag_shard`). With
    ``return_lse`` also the LSE of this rank's queries, (b, h, s/P), in the accumulation
    dtype (not differentiated). Every rank must pass equal shapes."""
    check_qkv(q, k, v)
    _, p = group_info(group)
    if k.size(1) != q.size(1):
        raise ValueError(f"ring attention needs q and k/v shards of one length, got {q.size(1)} and {k.size(1)}")
    if zigzag and q.size(1) % 2:
        raise ValueError(f"zigzag shards hold two equal chunks: a shard of {q.size(1)} tokens is odd "
                         f"(the sequence must be divisible by 2P = {2 * p})")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    out, lse = RingAttention.apply(q, k, v, causal, scale, zigzag, overlap, group)
    return (out, lse) if return_lse else out
