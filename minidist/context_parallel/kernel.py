"""Attention on one block of queries and one block of keys, returning the log-sum-exp.

Context parallelism cuts softmax(q kᵀ/√d) v into blocks of keys computed at different
times (ring attention) or on different heads (Ulysses). A block's result can only be
combined with the others if it carries, per query row, the log of its softmax
denominator (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
Dao et al. 2022, "FlashAttention", Sec. 3.1):

    lse_i = log Σ_j exp(s_ij),        out_i = Σ_j exp(s_ij − lse_i) v_j,   s = q kᵀ/√d

computed with the row maximum m subtracted first (out = Σ e^(s−m) v / Σ e^(s−m),
lse = m + log Σ e^(s−m)), so no exp ever sees a large argument, and s − m is exact for
the scores that dominate. The backward (FlashAttention, Alg. 4) needs only the *final*
output and LSE of the whole row, not the per-block ones:

    P = exp(S − lse),  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − D),  D_i = Σ_k dO_ik O_ik,
    dQ = dS K/√d,  dK = dSᵀ Q/√d

so any block can be redone on its own, in any order, and the parts summed.

**Causal blocks and global positions.** A block's mask is "key position > query
position", with the *global* positions of its rows and columns (``q_pos``, ``k_pos``,
each increasing). That covers every case by one rule: an earlier block is unmasked, a
later one empty, the diagonal one triangular, and a zigzag shard (two chunks far apart)
gets exactly the rectangles it can see. Positions also fix the alignment question for a
non-square block: torch's CPU SDPA aligns ``is_causal`` top-left, flash-attn
bottom-right; with explicit positions there is nothing to align. :func:`visible_window`
trims a block to the query rows that see at least one key (a suffix, positions being
increasing) and the keys that some query sees (a prefix), so fully masked rows and
columns are never computed. Positions are control data: the host decides from them which
block to compute and how much of it, so they live on the CPU (no device synchronisation
per block), and a block's mask is made from them on the scores' device.

Layout here is (batch, heads, seq, head_dim); ``k``/``v`` may have fewer heads than
``q`` (GQA/MQA: query head i reads kv head i // (h / h_kv)). Arithmetic runs in
:func:`acc_dtype` (fp32 for half inputs, fp64 stays fp64). Each block computed is
recorded as a ``minidist.trace`` span ``attention block`` with its size and its number
of unmasked scores: the per-rank work that zigzag balances, measured.
"""
from __future__ import annotations

import math

import torch

from minidist.models import repeat_kv
from minidist.trace import span

__all__ = ["acc_dtype", "check_qkv", "visible_window", "block_forward", "block_backward", "LocalAttention",
           "local_attention"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in fp32 at least (a bf16 running sum of exps loses the small terms)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible_window(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool):
    """(first visible row, last visible column + 1, whether a mask is needed), or None
    when no query of the block sees any key. Positions are increasing 1-D tensors."""
    if not causal:
        return 0, len(k_pos), False
    row0 = int(torch.searchsorted(q_pos, k_pos[0]))                 # rows with q_pos >= the first key
    col1 = int(torch.searchsorted(k_pos, q_pos[-1], right=True))    # keys with k_pos <= the last query
    if row0 == len(q_pos) or col1 == 0:
        return None
    return row0, col1, bool(k_pos[col1 - 1] > q_pos[row0])           # some key later than some query


def _scores(q, k, scale, mask):
    s = (q @ repeat_kv(k, q.size(1) // k.size(1)).transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def _mask(q_pos, k_pos, masked, device):
    """Key later than query, on the scores' ``device`` (None when no key of the block is)."""
    if not masked:
        return None
    return k_pos.to(device)[None, :] > q_pos.to(device)[:, None]


def _record(q_pos, k_pos, masked):
    # query i sees the keys up to its own position: a prefix of the increasing k_pos
    unmasked = int(torch.searchsorted(k_pos, q_pos, right=True).sum()) if masked else len(q_pos) * len(k_pos)
    return span("attention block", rows=len(q_pos), cols=len(k_pos), unmasked=unmasked)


def block_forward(q, k, v, scale, q_pos, k_pos, masked):
    """(out, lse) of ``q`` against the block ``k``, ``v`` (all already in the accumulation
    dtype and trimmed to the visible window)."""
    mask = _mask(q_pos, k_pos, masked, q.device)
    with _record(q_pos, k_pos, masked):
        s = _scores(q, k, scale, mask)
        m = s.amax(dim=-1, keepdim=True)            # s − m is exact near the max: the weights that matter
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        out = (e @ repeat_kv(v, q.size(1) // v.size(1))) / total
    return out, (m + total.log()).squeeze(-1)


def _sum_groups(x, h_kv):
    """Gradient of ``repeat_kv``: the query heads that share a kv head add up."""
    b, h, s, d = x.shape
    return x.view(b, h_kv, h // h_kv, s, d).sum(2)


def block_backward(q, k, v, dout, delta, lse, scale, q_pos, k_pos, masked):
    """(dq, dk, dv) of one block from the final ``lse`` and ``delta`` = rowsum(dO ∘ O)."""
    mask = _mask(q_pos, k_pos, masked, q.device)
    h_kv, g = k.size(1), q.size(1) // k.size(1)
    with _record(q_pos, k_pos, masked):
        p = torch.exp(_scores(q, k, scale, mask) - lse[..., None])     # masked entries: exp(-inf) = 0
        dv = _sum_groups(p.transpose(-2, -1) @ dout, h_kv)
        ds = p * (dout @ repeat_kv(v, g).transpose(-2, -1) - delta[..., None])
        dq = (ds @ repeat_kv(k, g)) * scale
        dk = _sum_groups(ds.transpose(-2, -1) @ q, h_kv) * scale
    return dq, dk, dv


def check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"{name} must be a 4-D floating-point tensor (batch, seq, heads, head_dim), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    if k.shape != v.shape or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"k and v must have one shape and q, k, v one dtype: q {tuple(q.shape)} {q.dtype}, "
                         f"k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} need equal batch and head_dim, and "
                         f"the query heads a multiple of the kv heads")


class LocalAttention(torch.autograd.Function):
    """Whole-sequence attention on one rank, (b, s, h, d) in, (out, lse) out; the LSE is
    returned for merging and is not differentiated."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, q_pos, k_pos):
        acc = acc_dtype(q.dtype)
        qh, kh, vh = (x.transpose(1, 2).to(acc) for x in (q, k, v))
        window = visible_window(q_pos, k_pos, causal)
        if window is None or window[0] != 0:
            raise ValueError("every query must see at least one key (its own position, when causal)")
        _, col1, masked = window
        out, lse = block_forward(qh, kh[:, :, :col1], vh[:, :, :col1], scale, q_pos, k_pos[:col1], masked)
        ctx.save_for_backward(qh, kh, vh, out, lse, q_pos, k_pos)
        ctx.window, ctx.scale, ctx.dtype = window, scale, q.dtype
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype).transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qh, kh, vh, out, lse, q_pos, k_pos = ctx.saved_tensors
        _, col1, masked = ctx.window
        dout = dout.transpose(1, 2).to(out.dtype)
        delta = (dout * out).sum(-1)
        dq, dk_part, dv_part = block_backward(qh, kh[:, :, :col1], vh[:, :, :col1], dout, delta, lse, ctx.scale,
                                              q_pos, k_pos[:col1], masked)
        dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)
        dk[:, :, :col1], dv[:, :, :col1] = dk_part, dv_part
        back = lambda x: x.to(ctx.dtype).transpose(1, 2)    # noqa: E731
        return back(dq), back(dk), back(dv), None, None, None, None


def local_attention(q, k, v, causal: bool = False, scale: float | None = None, q_pos=None, k_pos=None):
    """softmax(q kᵀ/√d) v on one rank: (out (b, s, h, d), lse (b, h, s)).

    ``q_pos``/``k_pos`` are the global positions of the rows (default 0..s-1, on the CPU)
    for the causal mask; the reference every context-parallel result is compared with."""
    check_qkv(q, k, v)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    q_pos = torch.arange(q.size(1), device="cpu") if q_pos is None else q_pos
    k_pos = torch.arange(k.size(1), device="cpu") if k_pos is None else k_pos
    return LocalAttention.apply(q, k, v, causal, scale, q_pos, k_pos)
