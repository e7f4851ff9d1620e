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
tokens' original order. The gradient of a permutation of rows across ranks is the inverse
permutation, so ``Dispatch.backward`` is combine's exchange and ``Combine.backward`` is
dispatch's: both are ``autograd.Function`` s. The routing weights get their gradient
through the weighted sum (a plain differentiable op).

Traffic per rank (as ``minidist.trace`` records payloads, an all-to-all its whole input):
dispatch forward 8·E bytes of counts + A_r·h·b, combine forward R_r·h·b, and the same
token bytes again in backward, swapped (combine's backward sends A_r rows, dispatch's R_r).
Formulas: ``minidist.cost.expert_parallel``. A group of one rank sends nothing.
Every tensor made here is on the tokens' device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info
from minidist.expert_parallel.router import check_moe_sizes

__all__ = ["DispatchPlan", "Dispatch", "Combine", "ep_dispatch", "ep_combine", "expert_owner"]

COUNT_DTYPE = torch.int64


@dataclass
class DispatchPlan:
    """What combine (and both backwards) need to undo a dispatch."""
    token_index: torch.Tensor       # (A,) the local token of each row sent, in send order
    choice: torch.Tensor            # (A,) which of its k choices (column of the routing tensors)
    send_splits: list[int]          # rows sent to each group rank (sums to A)
    recv_splits: list[int]          # rows received from each group rank (sums to R)
    order: torch.Tensor             # (R,) received row (source order) behind each expert-grouped row
    tokens_per_expert: list[int]    # rows each local expert got (sums to R)
    num_tokens: int                 # T, the local tokens
    num_experts: int                # E, over the whole group


def expert_owner(expert: int, num_experts: int, ep_size: int) -> int:
    """The EP-group rank holding ``expert`` (contiguous blocks of E/e experts)."""
    check_moe_sizes(num_experts, 1, None, ep_size)
    return expert // (num_experts // ep_size)


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """One uneven all-to-all of rows: send[i] rows to group rank i, recv[i] rows from it."""
    out = torch.empty((sum(recv),) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _to_experts(rows: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Send-ordered rows here → expert-grouped rows on the experts' ranks."""
    if len(plan.send_splits) > 1:
        rows = _exchange(rows, plan.send_splits, plan.recv_splits, group)
    return rows[plan.order]


def _to_sources(rows: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Expert-grouped rows → back to the ranks they came from, in their send order."""
    back = torch.empty_like(rows)
    back[plan.order] = rows
    if len(plan.send_splits) > 1:
        back = _exchange(back, plan.recv_splits, plan.send_splits, group)
    return back


class Dispatch(torch.autograd.Function):
    """Forward: rows to their experts' ranks. Backward: the gradients home (combine's exchange)."""

    @staticmethod
    def forward(ctx, rows, plan, group):
        ctx.plan, ctx.group = plan, group
        return _to_experts(rows, plan, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_sources(grad, ctx.plan, ctx.group), None, None


class Combine(torch.autograd.Function):
    """Forward: experts' outputs home. Backward: their gradients to the experts (dispatch's exchange)."""

    @staticmethod
    def forward(ctx, rows, plan, group):
        ctx.plan, ctx.group = plan, group
        return _to_sources(rows, plan, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_experts(grad, ctx.plan, ctx.group), None, None


def _check_inputs(tokens, expert_indices, num_experts, mask, ep_size) -> None:
    check_moe_sizes(num_experts, 1, None, ep_size)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a (tokens, hidden) tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    if (not isinstance(expert_indices, torch.Tensor) or expert_indices.dim() != 2
            or expert_indices.shape[0] != tokens.shape[0]):
        raise ValueError(f"expert_indices must be (tokens={tokens.shape[0]}, k), got "
                         f"{tuple(getattr(expert_indices, 'shape', ()))}")
    if mask is not None and tuple(mask.shape) != tuple(expert_indices.shape):
        raise ValueError(f"mask must match expert_indices {tuple(expert_indices.shape)}, got {tuple(mask.shape)}")
    if expert_indices.numel() and not 0 <= int(expert_indices.min()) <= int(expert_indices.max()) < num_experts:
        raise ValueError(f"expert_indices must lie in 0..{num_experts - 1}")


def ep_dispatch(tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                mask: torch.Tensor | None = None, group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """Send each kept (token, choice) row to the rank of its expert.

    tokens (T, h), expert_indices (T, k), mask (T, k) bool or None (all kept). Returns the rows
    this rank's experts must process, grouped by local expert (``plan.tokens_per_expert``
    rows each, in expert order), and the plan :func:`ep_combine` needs. Differentiable."""
    _, e = group_info(group)
    _check_inputs(tokens, expert_indices, num_experts, mask, e)
    local, k = num_experts // e, expert_indices.shape[1]
    kept = torch.ones_like(expert_indices, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    pairs = kept.reshape(-1).nonzero().squeeze(1)                  # flat (token, choice) index t·k + j
    experts = expert_indices.reshape(-1)[pairs]
    experts, by_expert = torch.sort(experts, stable=True)
    pairs = pairs[by_expert]
    counts = torch.bincount(experts, minlength=num_experts).to(COUNT_DTYPE)   # (E,), rows per expert
    if e > 1:                                                      # counts first: equal splits of L each
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
    else:
        received = counts
    received = received.reshape(e, local)                          # [source, local expert]
    send_splits = counts.reshape(e, local).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    expert_of_row = torch.arange(local, device=tokens.device).repeat(e).repeat_interleave(received.reshape(-1))
    order = torch.sort(expert_of_row, stable=True).indices
    plan = DispatchPlan(token_index=pairs // k, choice=pairs % k, send_splits=send_splits, recv_splits=recv_splits,
                        order=order, tokens_per_expert=received.sum(dim=0).tolist(), num_tokens=tokens.shape[0],
                        num_experts=num_experts)
    return Dispatch.apply(tokens[plan.token_index], plan, group), plan


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
    if weights.dim() != 2 or weights.shape[0] != plan.num_tokens:
        raise ValueError(f"weights must be (tokens={plan.num_tokens}, k), got {tuple(weights.shape)}")
    rows = Combine.apply(expert_outputs, plan, group)
    w = weights[plan.token_index, plan.choice].to(rows.dtype).unsqueeze(1)
    out = torch.zeros(plan.num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, plan.token_index, rows * w)
