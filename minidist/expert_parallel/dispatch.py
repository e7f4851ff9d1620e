"""Dispatch and combine: tokens travel to the ranks that hold their experts, and back.

Lepikhin et al. 2021 ("GShard", Sec. 2.2 and 3.2: dispatch and combine around the experts,
one all-to-all each way); Fedus et al. 2022 ("Switch Transformers", Fig. 3); the
count-exchange-then-tokens scheme of dropless MoE (Gale et al. 2023, "MegaBlocks";
Megatron-Core's all-to-all token dispatcher).

E experts over an expert-parallel (EP) group of e ranks: group rank r holds the L = E/e
experts r·L .. r·L + L − 1 (contiguous blocks). On every rank, for its T local tokens:

1. the kept (token, choice) pairs are sorted by expert (stable: token order inside an
   expert), so the rows for group rank 0 come first, then rank 1's, ...;
2. **counts first**: each rank sends the E counts (rows per expert, int64) with one
   equal-split all-to-all: rank r receives, from every source, how many rows each of its L
   experts will get; so every rank knows its receive splits before any token moves;
3. **tokens**: one ``all_to_all_single`` with uneven splits (A_r rows out, R_r rows in);
4. the received rows, ordered by source rank, are regrouped by local expert (stable: by
   source inside an expert), ready for ``experts[l](rows of expert l)``.

Combine is the exact inverse (undo the regrouping, the all-to-all with the splits swapped)
followed by the weighted sum y_t = Σ_{kept j} w_{t,j} · expert_{i_{t,j}}(x_t), in the
tokens' original order. Both are built on :func:`~minidist.expert_parallel.exchange.all_to_all_rows`,
whose backward is the same exchange with the splits swapped; the regrouping is plain
indexing (the gradient of a permutation is the inverse permutation), so dispatch's backward
is combine's exchange and combine's is dispatch's. The routing weights get their gradient
through the weighted sum.

Traffic per rank (as ``minidist.trace`` records payloads, an all-to-all its whole input):
dispatch forward 8·E bytes of counts + A_r·h·b, combine forward R_r·h·b, and the same
token bytes again in backward, swapped (combine's backward sends A_r rows, dispatch's R_r).
Formulas: ``minidist.cost.expert_parallel``. A group of one rank sends nothing.
Every tensor made here is on the tokens' device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info
from minidist.expert_parallel.exchange import all_to_all_rows
from minidist.expert_parallel.router import check_moe_sizes

__all__ = ["DispatchPlan", "ep_dispatch", "ep_combine", "expert_owner"]

COUNT_DTYPE = torch.int64


@dataclass
class DispatchPlan:
    """What combine (and both backwards) need to undo a dispatch: the pairs this rank sent and the
    counts both ways; the rest follows from them."""
    pairs: torch.Tensor             # (A,) the kept (token, choice) pairs sent, numbered token·k + choice, in send order
    k: int                          # choices per token
    send_counts: torch.Tensor       # (E,) int64: rows sent to each expert of the group
    recv_counts: torch.Tensor       # (e, E/e) int64: rows received from each group rank for each local expert
    num_tokens: int                 # T, the local tokens
    token_index: torch.Tensor = field(init=False)    # (A,) the local token of each row sent, in send order
    choice: torch.Tensor = field(init=False)         # (A,) which of its k choices (column of the routing tensors)
    send_splits: list[int] = field(init=False)       # rows sent to each group rank (sums to A)
    recv_splits: list[int] = field(init=False)       # rows received from each group rank (sums to R)
    order: torch.Tensor = field(init=False)          # (R,) received row (source order) behind each expert-grouped row
    by_source: torch.Tensor = field(init=False)      # (R,) the inverse: expert-grouped row of each received row
    tokens_per_expert: list[int] = field(init=False)  # rows each local expert got (sums to R)
    num_experts: int = field(init=False)             # E, over the whole group

    def __post_init__(self):
        if self.recv_counts.dim() != 2 or self.send_counts.numel() != self.recv_counts.numel():
            raise ValueError(f"recv_counts must be (group ranks, local experts) with as many counts as send_counts "
                             f"{tuple(self.send_counts.shape)}, got {tuple(self.recv_counts.shape)}")
        e, local = self.recv_counts.shape
        self.num_experts = self.send_counts.numel()
        self.token_index, self.choice = self.pairs // self.k, self.pairs % self.k
        self.send_splits = self.send_counts.reshape(e, local).sum(dim=1).tolist()
        self.recv_splits = self.recv_counts.sum(dim=1).tolist()
        self.tokens_per_expert = self.recv_counts.sum(dim=0).tolist()
        # rows arrive source by source, each source's in expert order: a stable sort by local expert regroups them
        device = self.recv_counts.device
        expert_of_row = torch.arange(local, device=device).repeat(e).repeat_interleave(self.recv_counts.reshape(-1))
        self.order = torch.sort(expert_of_row, stable=True).indices
        self.by_source = torch.empty_like(self.order)
        self.by_source[self.order] = torch.arange(len(self.order), device=device)


def expert_owner(expert: int, num_experts: int, ep_size: int) -> int:
    """The EP-group rank holding ``expert`` (contiguous blocks of E/e experts)."""
    check_moe_sizes(num_experts, 1, None, ep_size)
    return expert // (num_experts // ep_size)


def check_indices(expert_indices, num_experts: int, mask=None, ep_size: int = 1, tokens: int | None = None) -> None:
    """ValueError unless ``expert_indices`` is (tokens, k) of experts in 0..E−1 (and ``mask`` matches it)."""
    check_moe_sizes(num_experts, 1, None, ep_size)
    if (not isinstance(expert_indices, torch.Tensor) or expert_indices.dim() != 2
            or (tokens is not None and expert_indices.shape[0] != tokens)):
        raise ValueError(f"expert_indices must be (tokens{'' if tokens is None else f'={tokens}'}, k), got "
                         f"{tuple(getattr(expert_indices, 'shape', ()))}")
    if mask is not None and tuple(mask.shape) != tuple(expert_indices.shape):
        raise ValueError(f"mask must match expert_indices {tuple(expert_indices.shape)}, got {tuple(mask.shape)}")
    if expert_indices.numel() and not 0 <= int(expert_indices.min()) <= int(expert_indices.max()) < num_experts:
        raise ValueError(f"expert_indices must lie in 0..{num_experts - 1}")


def sorted_pairs(expert_indices: torch.Tensor, num_experts: int, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kept (token, choice) pairs in send order, (E,) rows per expert): pairs numbered
    token·k + choice, sorted by expert (stable: token order inside an expert). Step 1 of a dispatch."""
    kept = torch.ones_like(expert_indices, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    pairs = kept.reshape(-1).nonzero().squeeze(1)                  # flat (token, choice) index t·k + j
    experts, by_expert = torch.sort(expert_indices.reshape(-1)[pairs], stable=True)
    return pairs[by_expert], torch.bincount(experts, minlength=num_experts).to(COUNT_DTYPE)


def ep_dispatch(tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                mask: torch.Tensor | None = None, group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """Send each kept (token, choice) row to the rank of its expert.

    tokens (T, h), expert_indices (T, k), mask (T, k) bool or None (all kept). Returns the rows
    this rank's experts must process, grouped by local expert (``plan.tokens_per_expert``
    rows each, in expert order), and the plan :func:`ep_combine` needs. Differentiable."""
    _, e = group_info(group)
    check_moe_sizes(num_experts, 1, None, e)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a (tokens, hidden) tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    check_indices(expert_indices, num_experts, mask, e, tokens.shape[0])
    pairs, counts = sorted_pairs(expert_indices, num_experts, mask)
    if e > 1:                                                      # counts first: equal splits of L each
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
    else:
        received = counts
    plan = DispatchPlan(pairs, expert_indices.shape[1], counts, received.reshape(e, num_experts // e),
                        tokens.shape[0])
    rows = all_to_all_rows(tokens[plan.token_index], plan.send_splits, plan.recv_splits, group)
    return rows[plan.order], plan


def ep_combine(expert_outputs: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan, group=None) -> torch.Tensor:
    """Bring the experts' outputs home and sum each token's kept choices weighted by the router.

    expert_outputs (R, h) in the order :func:`ep_dispatch` returned, weights (T, k) (the
    router's, differentiable). Returns (T, h) in the tokens' original order; a token whose
    choices were all dropped gets zeros. Differentiable in both inputs."""
    _, e = group_info(group)
    if len(plan.send_splits) != e:
        raise ValueError(f"the plan was made for a group of {len(plan.send_splits)} ranks, this group has {e}")
    if expert_outputs.dim() != 2 or expert_outputs.shape[0] != sum(plan.tokens_per_expert):
        raise ValueError(f"expert_outputs must be ({sum(plan.tokens_per_expert)}, hidden) as dispatched, "
                         f"got {tuple(expert_outputs.shape)}")
    if tuple(weights.shape) != (plan.num_tokens, plan.k):
        raise ValueError(f"weights must be (tokens={plan.num_tokens}, k={plan.k}), got {tuple(weights.shape)}")
    rows = all_to_all_rows(expert_outputs[plan.by_source], plan.recv_splits, plan.send_splits, group)
    w = weights[plan.token_index, plan.choice].to(rows.dtype).unsqueeze(1)
    out = torch.zeros(plan.num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, plan.token_index, rows * w)
