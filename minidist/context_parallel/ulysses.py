"""DeepSpeed-Ulysses: sequence-sharded in, head-sharded attention, sequence-sharded out.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models", Sec. 3. Outside attention every op is
per-token, so rank r holds tokens [r·s/P, (r+1)·s/P) of q, k, v: (b, s/P, h, d). Attention
needs whole sequences but is independent per head, so an all-to-all trades the sharded
dim: (b, s/P, h, d) → (b, s, h/P, d), local attention over the full sequence on h/P
heads, and the inverse all-to-all brings the output back to (b, s/P, h, d).

Forward: 4 all-to-alls (q, k, v, out); backward: 4 (their swapped versions). Per rank each
moves (P−1)/P of a (b, s/P, ·, d) tensor: traffic per rank ∝ s/P, constant in P for a
fixed s/P (Sec. 3.2); the cost is ``minidist.cost.ulysses_collectives``.

Constraint: P divides h (each rank gets whole heads). GQA/MQA (h_kv < h key/value heads):
  * ``h_kv % P == 0``: kv heads split like the query heads; rank r's query heads read
    exactly its kv heads (query head i reads kv head i·h_kv/h);
  * ``P % h_kv == 0``: each rank's query heads all read one kv head, so each kv head is
    *replicated* P/h_kv times before the all-to-all (rank r receives kv head r·h_kv/P);
    the expansion's backward sums the replicas' gradients;
  * otherwise a ValueError: some rank's query heads would straddle kv heads unevenly.
Replication is why MQA does not cut Ulysses' kv traffic below one head per rank.
"""
from __future__ import annotations

import torch

from minidist.collectives.p2p import group_info
from minidist.context_parallel.all_to_all import all_to_all
from minidist.context_parallel.kernel import check_qkv, local_attention

__all__ = ["seq_to_heads", "heads_to_seq", "kv_heads_per_rank", "replicate_kv_heads", "ulysses_attention"]

SEQ, HEADS = 1, 2       # (batch, seq, heads, head_dim)


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s/P, h, d) → (b, s, h/P, d)."""
    return all_to_all(x, HEADS, SEQ, group)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s, h/P, d) → (b, s/P, h, d)."""
    return all_to_all(x, SEQ, HEADS, group)


def kv_heads_per_rank(n_heads: int, n_kv_heads: int, p: int) -> tuple[int, bool]:
    """(kv heads each rank receives, whether they are replicas); ValueError if P fits neither way."""
    if n_heads % p:
        raise ValueError(f"Ulysses needs the {n_heads} query heads divisible by the {p} ranks")
    if n_kv_heads % p == 0:
        return n_kv_heads // p, False
    if p % n_kv_heads == 0:
        return 1, True
    raise ValueError(f"{n_kv_heads} kv heads on {p} ranks: neither split (h_kv % P == 0) nor "
                     f"replicated (P % h_kv == 0)")


def replicate_kv_heads(x: torch.Tensor, p: int) -> torch.Tensor:
    """(b, s/P, h_kv, d) → (b, s/P, P, d), kv head j at places [j·P/h_kv, (j+1)·P/h_kv)."""
    b, s, h_kv, d = x.shape
    return x[:, :, :, None].expand(b, s, h_kv, p // h_kv, d).reshape(b, s, p, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, group=None,
                      scale: float | None = None, return_lse: bool = False):
    """Attention on sequence shards (b, s/P, h, d) (contiguous: rank r holds chunk r),
    returning this rank's shard of the output, (b, s/P, h, d); with ``return_lse`` also
    the LSE of this rank's *heads* over the whole sequence, (b, h/P, s)."""
    check_qkv(q, k, v)
    _, p = group_info(group)
    _, replicated = kv_heads_per_rank(q.size(HEADS), k.size(HEADS), p)
    if replicated:
        k, v = replicate_kv_heads(k, p), replicate_kv_heads(v, p)
    qh, kh, vh = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)
    out, lse = local_attention(qh, kh, vh, causal, scale)
    out = heads_to_seq(out, group)
    return (out, lse) if return_lse else out
