"""2D sequence parallelism: Ulysses inside a group, ring attention across groups.

Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context
Generative AI", Sec. 4. Ulysses alone is capped at P ≤ h (whole heads per rank; P ≤ h_kv
without replication) and its all-to-alls span every rank; the ring alone sends O(s) bytes
per rank whatever P. Arrange P = R·U ranks in a grid: U ranks of a *Ulysses group*
(consecutive ranks, e.g. one node's fast links) share one ring shard of the sequence, and
the R groups form a ring (ranks with the same Ulysses index). Then

    (b, s/P, h, d) --all-to-all in the Ulysses group--> (b, s/R, h/U, d)
                   --ring attention over the R groups, on h/U heads--> (b, s/R, h/U, d)
                   --all-to-all back--> (b, s/P, h, d)

Ulysses' 8 all-to-alls move (b, s/P, ·, d) shards within a group
(``minidist.cost.ulysses_collectives`` with s/R tokens and U ranks); the ring passes
(b, s/R, h_kv/U, d) blocks (``ring_attention_messages`` with h_kv/U kv heads, or one
replicated head when U % h_kv == 0). Zigzag applies at the ring level: group r holds
ring shard r (chunks r and 2R−1−r of 2R), each member a contiguous 1/U of it
(:func:`hybrid_shard`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info
from minidist.context_parallel.kernel import check_qkv
from minidist.context_parallel.ring import ring_attention
from minidist.context_parallel.ulysses import (HEADS, heads_to_seq, kv_heads_per_rank, replicate_kv_heads,
                                              seq_to_heads)
from minidist.context_parallel.zigzag import shard

__all__ = ["new_hybrid_groups", "hybrid_shard", "hybrid_attention"]


def new_hybrid_groups(ulysses_size: int):
    """(Ulysses group, ring group) of this rank: Ulysses groups of ``ulysses_size``
    consecutive ranks, ring groups of the ranks with the same place in theirs.
    ``dist.new_group`` is collective over the world: every rank creates every group."""
    world = group_info(None)[1]
    if not isinstance(ulysses_size, int) or ulysses_size < 1 or world % ulysses_size:
        raise ValueError(f"a Ulysses size of {ulysses_size!r} does not divide a world of {world} ranks")
    me = dist.get_rank()
    ulysses = ring = None
    for start in range(0, world, ulysses_size):
        group = dist.new_group(list(range(start, start + ulysses_size)))
        if start <= me < start + ulysses_size:
            ulysses = group
    for u in range(ulysses_size):
        group = dist.new_group(list(range(u, world, ulysses_size)))
        if me % ulysses_size == u:
            ring = group
    return ulysses, ring


def hybrid_shard(x: torch.Tensor, ring_rank: int, ring_size: int, ulysses_rank: int, ulysses_size: int,
                 zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """The tokens of rank (``ring_rank``, ``ulysses_rank``): its 1/U of ring shard ``ring_rank``."""
    piece = shard(x, ring_rank, ring_size, zigzag, dim)
    if piece.size(dim) % ulysses_size:
        raise ValueError(f"a ring shard of {piece.size(dim)} tokens does not cut into {ulysses_size} pieces")
    return piece.chunk(ulysses_size, dim)[ulysses_rank]


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     ulysses_group=None, ring_group=None, zigzag: bool = False, scale: float | None = None):
    """Attention on :func:`hybrid_shard` pieces (b, s/P, h, d) → this rank's output piece."""
    check_qkv(q, k, v)
    _, u = group_info(ulysses_group)
    group_info(ring_group)
    _, replicated = kv_heads_per_rank(q.size(HEADS), k.size(HEADS), u)
    if zigzag and (q.size(1) * u) % 2:
        raise ValueError(f"zigzag ring shards hold two equal chunks: {q.size(1) * u} tokens is odd")
    if replicated:
        k, v = replicate_kv_heads(k, u), replicate_kv_heads(v, u)
    qh, kh, vh = (seq_to_heads(x, ulysses_group) for x in (q, k, v))
    out = ring_attention(qh, kh, vh, causal, ring_group, zigzag=zigzag, scale=scale)
    return heads_to_seq(out, ulysses_group)
