"""Cut a sequential model into pipeline stages.

Stages are contiguous runs of layers. ``balanced`` picks the cut points that minimise
the largest stage's parameter count (the classic linear-partition problem, solved by
dynamic programming; n and k are small): parameter count is the usual stand-in for
both the memory a stage holds and, for matmul-dominated layers, its compute time.
"""
from __future__ import annotations

import torch.nn as nn


def balanced_boundaries(sizes: list[int], k: int) -> list[int]:
    """Cut indices (k - 1 of them) splitting ``sizes`` into k contiguous non-empty parts
    whose largest sum is as small as possible."""
    n = len(sizes)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} non-empty stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[j][i]: smallest possible max-part over the first i layers cut into j parts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):            # last part is layers c..i-1
                cost = max(best[j - 1][c], prefix[i] - prefix[c])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        cuts.append(i)
    return cuts[::-1]


def partition(layers, num_stages: int, boundaries: list[int] | None = None) -> list[nn.Sequential]:
    """Split ``layers`` (an ``nn.Sequential`` or a list of modules) into ``num_stages`` stages.

    ``boundaries``: explicit cut indices, e.g. ``[2, 5]`` gives layers [0:2], [2:5], [5:].
    Without it, stages are balanced by parameter count. The stages share the original
    modules (no copies), so a stage's parameters are the model's.
    """
    layers = list(layers)
    if boundaries is None:
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        boundaries = balanced_boundaries(sizes, num_stages)
    boundaries = list(boundaries)
    if len(boundaries) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} boundaries, got {boundaries}")
    if any(b <= a for a, b in zip([0] + boundaries, boundaries + [len(layers)])):
        raise ValueError(f"boundaries {boundaries} must be strictly increasing inside (0, {len(layers)}): "
                         "every stage needs at least one layer")
    edges = [0] + boundaries + [len(layers)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(edges, edges[1:])]


def rank_chunks(stages: list, p: int, rank: int) -> list:
    """The stages rank ``rank`` holds when ``len(stages) = p * v``: ``rank, rank + p, ...``
    (chunk c is stage c * p + rank, the layout every schedule here uses)."""
    if len(stages) % p:
        raise ValueError(f"{len(stages)} stages cannot be spread evenly over {p} ranks")
    return list(stages[rank::p])
