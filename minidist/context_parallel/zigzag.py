"""Which tokens a rank holds: contiguous shards, or zigzag ones that balance causal work.

Causal attention lets query i see keys 0..i, so with contiguous shards rank r's queries
see r·s/P + O(s/P) keys each: the last rank does about 2 − 1/P times the mean work and
the first almost none, and the ring's step time is the last rank's (Brandon et al. 2023,
"Striped Attention: Faster Ring Attention for Causal Transformers", Sec. 3; the zigzag
layout below is the one of Zhu's ring-flash-attention and Llama 3's context parallelism,
Dubey et al. 2024, Sec. 3.3.2).

**Zigzag.** Cut the sequence into 2P chunks of c = s/(2P); rank r holds chunks r and
2P−1−r. Each rank gets one early and one late chunk, and the work is exactly equal: rank
r's unmasked scores are c·r·c + c(c+1)/2 + c·(2P−1−r)·c + c(c+1)/2 = (2P−1)c² + c(c+1),
independent of r. In the ring, every off-diagonal block is then exactly half a block:
for a key block from an earlier rank (j < r) all queries see its first chunk and none its
second; from a later rank (j > r) only the second query chunk sees it, all of it. Needs
s divisible by 2P (ValueError otherwise).

Positions (causal masks, RoPE) must be the *global* ones: :func:`shard_positions`.
"""
from __future__ import annotations

import torch

from minidist.runtime.device import device as current_device

__all__ = ["shard_positions", "shard", "unshard", "zigzag_shard"]


def _check(seq: int, world_size: int, zigzag: bool) -> int:
    parts = 2 * world_size if zigzag else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if seq % parts:
        raise ValueError(f"a sequence of {seq} tokens does not cut into {parts} equal chunks "
                         f"({'zigzag: 2P' if zigzag else 'P'} with P = {world_size})")
    return seq // parts


def shard_positions(seq: int, rank: int, world_size: int, zigzag: bool = False, device=None) -> torch.Tensor:
    """Global positions of the tokens rank ``rank`` holds, increasing, on ``device``
    (default: this rank's)."""
    c = _check(seq, world_size, zigzag)
    device = device or current_device()
    if not zigzag:
        return torch.arange(rank * c, (rank + 1) * c, device=device)
    late = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(late * c, (late + 1) * c, device=device)])


def shard(x: torch.Tensor, rank: int, world_size: int, zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of the full ``x`` (sequence along ``dim``)."""
    return x.index_select(dim, shard_positions(x.size(dim), rank, world_size, zigzag, x.device))


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Chunks ``rank`` and 2P−1−``rank`` of 2P, concatenated along ``dim``."""
    return shard(x, rank, world_size, True, dim)


def unshard(shards: list[torch.Tensor], zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order), inverse of :func:`shard`."""
    p = len(shards)
    full = torch.cat(shards, dim)
    order = torch.cat([shard_positions(full.size(dim), r, p, zigzag, full.device) for r in range(p)])
    return full.index_select(dim, torch.argsort(order))
