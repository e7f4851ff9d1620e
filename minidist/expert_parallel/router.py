"""The top-k router: which experts each token goes to, with what weight, and which choices are dropped.

Shazeer et al. 2017 ("Outrageously Large Neural Networks", top-k gating); Lepikhin et al.
2021 ("GShard", Sec. 2.2: expert capacity, tokens over it dropped); Fedus et al. 2022
("Switch Transformers", Sec. 2.2: the capacity factor). For T tokens and E experts, with
router logits ``z`` of shape (T, E):

    p = softmax(z)                       # (T, E), over the experts
    top-k of each row: experts i_1..i_k, weights w_j = p_{i_j} / Σ_j p_{i_j}   (renormalised, Mixtral-style)
    capacity C = ceil(capacity_factor · T · k / E)   slots per expert

Dropping: the (token, choice) pairs are served in GShard's priority order, every token's
first choice before any second choice, and within a choice in token order; an expert
accepts its first C pairs and drops the rest (``mask`` False). A dropped pair contributes
nothing to the token's output (the residual connection around the layer carries the token).
``capacity_factor=None`` is *dropless* (MegaBlocks, Gale et al. 2023): every pair is kept.

Capacity is per call, i.e. per rank's local tokens (GShard's "groups"): under expert
parallelism each rank routes its own tokens, so one process reproduces it by routing each
rank's tokens separately. No communication here; everything is on ``logits.device``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Routing", "top_k_router", "expert_capacity", "check_moe_sizes", "within_capacity"]


class Routing(NamedTuple):
    indices: torch.Tensor       # (T, k) int64: the chosen experts, most probable first
    weights: torch.Tensor       # (T, k): their renormalised probabilities (differentiable)
    mask: torch.Tensor          # (T, k) bool: the (token, choice) pairs kept (all True when dropless)
    probs: torch.Tensor         # (T, E): softmax over the experts (differentiable; the balancing loss uses it)
    capacity: int | None        # slots per expert, None when dropless


def check_moe_sizes(num_experts: int, k: int, capacity_factor: float | None = None, ep_size: int = 1) -> None:
    """ValueError for sizes no MoE layer can use: E not divisible by the EP size, k outside 1..E,
    a capacity factor ≤ 0. Called by every entry point before anything is computed or sent."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be an int in 1..{num_experts} (the number of experts), got k={k!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless routing), got {capacity_factor!r}")
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over an expert-parallel group of {ep_size} ranks "
                         f"(E must be divisible by e)")


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert: ceil(capacity_factor · tokens · k / E); None (no limit) when dropless."""
    check_moe_sizes(num_experts, k, capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * k / num_experts)


def top_k_router(logits: torch.Tensor, k: int, capacity_factor: float | None = None) -> Routing:
    """Route T tokens from their router logits (T, E): top-k experts, renormalised weights,
    the kept mask under ``capacity_factor`` (None: dropless). See the module docstring."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"router logits must be a (tokens, experts) tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    tokens, num_experts = logits.shape
    check_moe_sizes(num_experts, k, capacity_factor)
    probs = torch.softmax(logits, dim=-1)
    top, indices = torch.topk(probs, k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True)
    capacity = expert_capacity(tokens, num_experts, k, capacity_factor)
    if capacity is None:
        mask = torch.ones(tokens, k, dtype=torch.bool, device=logits.device)
    else:
        # priority order: choice 0 of every token, then choice 1, ...
        mask = within_capacity(indices.t().reshape(-1), num_experts, capacity).reshape(k, tokens).t()
    return Routing(indices, weights, mask, probs, capacity)


def within_capacity(queue: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """For expert choices served in ``queue``'s order (1-D), whether each is among the first
    ``capacity`` choices of its expert (its position: the earlier choices of the same expert)."""
    one_hot = torch.nn.functional.one_hot(queue, num_experts)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1
    return position < capacity
