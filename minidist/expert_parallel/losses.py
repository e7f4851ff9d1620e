"""The router's auxiliary losses: load balancing (Switch/GShard) and the z-loss (ST-MoE).

**Load-balancing loss** (Fedus et al. 2022, "Switch Transformers", Sec. 2.2, eq. 4–6;
GShard's l_aux, Lepikhin et al. 2021, Sec. 2.2): with f_i the share of the T·k routing
choices that picked expert i (counted before capacity drops anything) and P_i the mean
router probability of expert i over the tokens,

    L_balance = E · Σ_i f_i · P_i

f is a count (no gradient); the gradient flows through P and pushes probability away from
the experts that are chosen too often. Uniform routing gives exactly 1 for any k (f_i =
P_i = 1/E), all tokens on one expert gives E.

**Router z-loss** (Zoph et al. 2022, "ST-MoE", Sec. 3.2, eq. 5): the mean over tokens of
(log Σ_j exp z_j)², which keeps the router logits small (bf16 softmax is stable then).

Both are over the tokens given (one rank's, under data parallelism: average them over the
ranks like the task loss). No communication; results on the inputs' device.
"""
from __future__ import annotations

import torch

__all__ = ["load_balancing_loss", "router_z_loss", "tokens_per_expert"]


def tokens_per_expert(expert_indices: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(E,) int64: how many routing choices picked each expert (only the kept ones when ``mask`` is given)."""
    chosen = expert_indices.reshape(-1)
    if mask is not None:
        chosen = chosen[mask.reshape(-1)]
    return torch.bincount(chosen, minlength=num_experts)


def load_balancing_loss(router_probs: torch.Tensor, expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E · Σ_i f_i · P_i for router probabilities (T, E) and chosen experts (T, k)."""
    if router_probs.dim() != 2 or router_probs.shape[1] != num_experts:
        raise ValueError(f"router_probs must be (tokens, {num_experts}), got {tuple(router_probs.shape)}")
    if expert_indices.dim() != 2 or expert_indices.shape[0] != router_probs.shape[0]:
        raise ValueError(f"expert_indices must be (tokens={router_probs.shape[0]}, k), got "
                         f"{tuple(expert_indices.shape)}")
    f = tokens_per_expert(expert_indices, num_experts).to(router_probs.dtype) / expert_indices.numel()
    return num_experts * (f * router_probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(logits)² (logits (T, E))."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be (tokens, experts), got {tuple(logits.shape)}")
    return torch.logsumexp(logits, dim=-1).square().mean()
