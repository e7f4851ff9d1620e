"""Merging two partial attention results through their log-sum-exps.

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
Sec. 3 (after Rabe & Staats 2021 and FlashAttention's online softmax). If rows of
``out_a`` are softmax-weighted averages over key set A with log-denominator ``lse_a``, and
likewise for B, then over A ∪ B

    lse = log(e^lse_a + e^lse_b),     out = (e^lse_a out_a + e^lse_b out_b) / e^lse.

Written that way both exps overflow once scores reach ~89 (fp32) and adding the lse's
(a classic bug) is the log of a *product*. Divided through by e^lse the weights are
sigmoids of lse differences, which never overflow:

    out = out_a − σ(lse_b − lse_a) · (out_a − out_b)
    lse = lse_a − log σ(lse_a − lse_b)                     (log σ(x) = −softplus(−x))

The lse line is symmetric in a and b; we take the larger one as lse_a, so the result is
that value plus a term in [0, log 2]: one rounding at the lse's magnitude instead of
several. That matters in fp32 once scores reach ~100 (one ulp there is 8e-6): the
backward recomputes every probability as exp(s − lse).

Both sides must have seen at least one key per row (finite lse); the ring always merges
into the diagonal block, where every query sees itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["merge_partial_attention"]


def merge_partial_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) over the union of the two key sets. ``out_*`` (..., rows, d), ``lse_*``
    (..., rows); the result is in their (accumulation) dtype."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"partial results disagree: out {tuple(out_a.shape)} vs {tuple(out_b.shape)}, "
                         f"lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}")
    out = out_a - torch.sigmoid(lse_b - lse_a)[..., None] * (out_a - out_b)
    lse = torch.maximum(lse_a, lse_b) - F.logsigmoid((lse_a - lse_b).abs())
    return out, lse
