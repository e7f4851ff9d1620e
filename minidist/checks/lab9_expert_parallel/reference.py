"""Lab 9's reference: the lab's five functions as its notebook states them, and the routing plan of a
whole expert-parallel group computed in one process.

Shazeer et al. 2017 (top-k gating), Lepikhin et al. 2020 (GShard: capacity, first choices before
second choices, dispatch by all-to-all), Fedus et al. 2021 (Switch: the load-balancing loss
``E · Σ_i f_i · P_i``). The checks stand these in for the notebook's other functions inside the ranks
(a mistake in ``ep_dispatch`` costs its own test, not ``moe_layer``'s), and build every expected
value from :func:`plan`, which needs every rank's choices but no communication. The one file of
this lab's checks besides the four of every lab: the lab's own implementation, whole.

The contract (the lab's): E experts over a group of e ranks, group rank r owns experts
``r·E/e .. (r+1)·E/e − 1``. A (token, choice) pair is numbered ``token·k + choice``; a dropped
choice has expert index −1. A rank sends its pairs sorted by expert (token order within an expert);
its experts receive rows grouped by local expert, then by source rank, then in token order.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Route(NamedTuple):
    """What ``ep_combine`` needs to undo ``ep_dispatch`` (int64 tensors on the tokens' device)."""
    order: torch.Tensor         # (s,): the pairs this rank sent, token·k + choice, in the order sent
    send_counts: torch.Tensor   # (E,): rows this rank sent to each expert
    recv_counts: torch.Tensor   # (e, E/e): rows received from each group rank, for each local expert


def group_rank_size(group=None):
    return dist.get_rank(group), dist.get_world_size(group)


def capacity(capacity_factor: float, tokens: int, k: int, num_experts: int) -> int:
    """Slots per expert: ceil(capacity_factor · tokens · k / E)."""
    return math.ceil(capacity_factor * tokens * k / num_experts)


def queued_within(queue: torch.Tensor, slots: int, num_experts: int) -> torch.Tensor:
    """For expert choices in queue order (1-D), whether each is among its expert's first ``slots``."""
    onehot = F.one_hot(queue, num_experts)
    return (onehot.cumsum(0) * onehot).sum(-1) - 1 < slots


def sort_by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation taking rows received source by source (then expert) to expert by expert (then source)."""
    e, local = recv_counts.shape
    segment = torch.repeat_interleave(torch.arange(e * local, device=recv_counts.device), recv_counts.reshape(-1))
    return torch.argsort((segment % local) * e + segment // local, stable=True)


# ----------------------------------------------------------------------------- the lab's functions
def top_k_router(logits, k, capacity_factor=None):
    if logits.dim() != 2:
        raise ValueError(f"logits must be (tokens, experts), got shape {tuple(logits.shape)}")
    n, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k}: choose between 1 and {num_experts} experts")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive (None: no dropping), got {capacity_factor}")
    probs = torch.softmax(logits, dim=-1)
    top, indices = probs.topk(k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True)
    if capacity_factor is None:
        return indices, weights, torch.ones_like(indices, dtype=torch.bool)
    slots = capacity(capacity_factor, n, k, num_experts)
    # first choices first, then token order
    return indices, weights, queued_within(indices.t().reshape(-1), slots, num_experts).view(k, n).t()


def load_balancing_loss(router_probs, expert_indices, num_experts):
    n, k = expert_indices.shape
    if router_probs.shape != (n, num_experts):
        raise ValueError(f"router_probs {tuple(router_probs.shape)} does not match {n} tokens, {num_experts} experts")
    counts = torch.bincount(expert_indices.reshape(-1), minlength=num_experts)
    fraction = counts.to(router_probs.dtype) / (n * k)
    return num_experts * (fraction * router_probs.mean(dim=0)).sum()


class AllToAllRows(torch.autograd.Function):
    """Uneven all-to-all of rows; backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def _exchange(rows, send_splits, recv_splits, group):
    out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all_rows(rows, send_splits, recv_splits, group=None):
    return AllToAllRows.apply(rows, list(send_splits), list(recv_splits), group)


def ep_dispatch(tokens, expert_indices, num_experts, group=None):
    _, e = group_rank_size(group)
    if num_experts % e:
        raise ValueError(f"{num_experts} experts do not split over {e} ranks")
    if expert_indices.dim() != 2 or expert_indices.size(0) != tokens.size(0):
        raise ValueError(f"expert_indices {tuple(expert_indices.shape)} does not match {tokens.size(0)} tokens")
    k, flat = expert_indices.size(1), expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] >= 0]
    send_counts = torch.bincount(flat[order], minlength=num_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(e, num_experts // e)
    rows = all_to_all_rows(tokens[order // k], send_counts.view(e, -1).sum(1).tolist(),
                           recv_counts.sum(1).tolist(), group)
    return rows[sort_by_expert(recv_counts)], Route(order, send_counts, recv_counts)


def ep_combine(expert_outputs, weights, route, group=None):
    _, e = group_rank_size(group)
    n, k = weights.shape
    by_source = expert_outputs[torch.argsort(sort_by_expert(route.recv_counts))]
    rows = all_to_all_rows(by_source, route.recv_counts.sum(1).tolist(),
                           route.send_counts.view(e, -1).sum(1).tolist(), group)
    scaled = rows * weights.reshape(-1)[route.order].unsqueeze(-1).to(rows.dtype)
    out = torch.zeros((n,) + tuple(expert_outputs.shape[1:]), dtype=rows.dtype, device=rows.device)
    return out.index_add(0, route.order // k, scaled)


def moe_layer(x, router_weight, experts, k, group=None, capacity_factor=None):
    _, e = group_rank_size(group)
    if router_weight.dim() != 2 or router_weight.size(0) != x.size(-1):
        raise ValueError(f"router_weight {tuple(router_weight.shape)} does not match tokens of size {x.size(-1)}")
    num_experts = router_weight.size(1)
    if num_experts % e or len(experts) != num_experts // e:
        raise ValueError(f"{num_experts} experts over {e} ranks: each rank holds E/e of them, got {len(experts)}")
    logits = x @ router_weight
    indices, weights, keep = top_k_router(logits, k, capacity_factor)
    aux = load_balancing_loss(torch.softmax(logits, dim=-1), indices, num_experts)
    rows, route = ep_dispatch(x, indices.masked_fill(~keep, -1), num_experts, group)
    outputs = [expert(chunk) for expert, chunk in zip(experts, rows.split(route.recv_counts.sum(0).tolist()))]
    return ep_combine(torch.cat(outputs), weights, route, group), aux


# ----------------------------------------------------------------------------- a whole group, in one process
class Plan(NamedTuple):
    routes: list        # per group rank: Route (CPU)
    src: list           # per group rank: (m,) the source rank of each row its experts receive, in order
    pair: list          # per group rank: (m,) that row's pair number on its source


def plan(choices: list, num_experts: int) -> Plan:
    """Every group rank's Route and the rows its experts receive, from every rank's expert indices."""
    e = len(choices)
    local = num_experts // e
    routes = []
    for idx in choices:
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] >= 0]
        routes.append((order, torch.bincount(flat[order], minlength=num_experts), flat))
    recv = [torch.stack([routes[s][1][r * local:(r + 1) * local] for s in range(e)]) for r in range(e)]
    src, pair = [], []
    for r in range(e):
        rows = [(s, p) for j in range(local) for s in range(e)
                for p in routes[s][0].tolist() if int(routes[s][2][p]) == r * local + j]
        src.append(torch.tensor([s for s, _ in rows], dtype=torch.long, device=idx.device))
        pair.append(torch.tensor([p for _, p in rows], dtype=torch.long, device=idx.device))
    return Plan([Route(o, c, recv[r]) for r, (o, c, _) in enumerate(routes)], src, pair)
