"""The MoE layer on one process, written the plain way: the ground truth for every EP test.

No dispatch, no sort, no communication: for each expert j, the tokens whose kept choices
include j go through expert j, and each token sums its choices' outputs times their
weights (Shazeer et al. 2017, eq. 1, with GShard's capacity mask):

    y_t = Σ_j Σ_{c: i_{t,c} = j, kept} w_{t,c} · expert_j(x_t)

Expert parallelism routes each rank's tokens on that rank (capacity is per rank), so one
process reproduces an EP run of n ranks by calling this once per rank's block of tokens
(``groups=n``). Every expert runs, on an empty block if no token picked it, so every
parameter has a gradient (zeros), as on the ranks.
"""
from __future__ import annotations

import torch

from minidist.expert_parallel.router import Routing, check_moe_sizes, top_k_router

__all__ = ["moe_reference"]


def moe_reference(x: torch.Tensor, router_weight: torch.Tensor, experts, k: int,
                  capacity_factor: float | None = None, groups: int = 1) -> tuple[torch.Tensor, list[Routing]]:
    """All E ``experts`` on one process; x (..., h) cut into ``groups`` equal blocks of tokens,
    each routed on its own. Returns y shaped like x and each block's routing."""
    num_experts = router_weight.shape[0]
    check_moe_sizes(num_experts, k, capacity_factor)
    if len(experts) != num_experts:
        raise ValueError(f"the reference needs all {num_experts} experts, got {len(experts)}")
    tokens = x.reshape(-1, x.shape[-1])
    if tokens.shape[0] % groups:
        raise ValueError(f"{tokens.shape[0]} tokens do not split into {groups} equal groups")
    outs, routings = [], []
    for block in tokens.chunk(groups) if groups > 1 else [tokens]:
        routing = top_k_router(block @ router_weight.t(), k, capacity_factor)
        out = torch.zeros_like(block)
        for j, expert in enumerate(experts):
            hit = (routing.indices == j) & routing.mask                    # (T, k)
            weight = (routing.weights * hit).sum(dim=1)                    # a token picks j at most once
            rows = hit.any(dim=1).nonzero().squeeze(1)
            out = out.index_add(0, rows, expert(block[rows]) * weight[rows].unsqueeze(1).to(block.dtype))
        outs.append(out)
        routings.append(routing)
    return torch.cat(outs).reshape(x.shape), routings
