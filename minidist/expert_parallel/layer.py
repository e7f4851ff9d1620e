"""The Mixture-of-Experts layer sharded over an expert-parallel group.

Lepikhin et al. 2021 ("GShard", Sec. 2 and 3.2); Fedus et al. 2022 ("Switch Transformers");
Jiang et al. 2024 ("Mixtral of Experts": 8 experts, top-2, renormalised weights). With
E experts over an EP group of e ranks, each rank holds L = E/e experts (group rank r the
experts r·L .. r·L + L − 1) and the router's weight (E, h) whole (replicated):

    y = Σ_{kept choices j of token t} w_{t,j} · expert_{i_{t,j}}(x_t)

    logits = x Wᵣᵀ → top_k_router → ep_dispatch → each local expert on its rows → ep_combine

Per token the layer does k experts' FLOPs (2·k·3 · h·f per token forward for an MLP
expert), whatever E: the parameters grow with E, the compute with k only.

* :func:`moe_layer` is the functional form (the local experts passed in);
* :class:`MoELayer` holds a rank's share: the router weight, its L experts (parameters
  marked ``expert_parallel = True``, see :mod:`~minidist.expert_parallel.parallel`) and
  returns ``(y, aux_loss)``, aux = ``balance_coef`` · L_balance + ``z_coef`` · L_z;
* :func:`make_experts`, :func:`make_router_weight` draw every expert and the router on the
  CPU from a seed and move them (every rank and the single-process reference get the same
  numbers, on any device).

Bad sizes (E % e, k > E, a capacity factor ≤ 0, a router weight or an expert count that
does not match) are a ValueError before any collective.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.expert_parallel.dispatch import DispatchPlan, ep_combine, ep_dispatch
from minidist.expert_parallel.losses import load_balancing_loss, router_z_loss
from minidist.expert_parallel.router import Routing, check_moe_sizes, top_k_router
from minidist.runtime import device as rank_device

__all__ = ["ExpertMLP", "make_experts", "make_router_weight", "run_experts", "moe_layer", "MoELayer",
           "local_expert_range"]


class ExpertMLP(nn.Module):
    """One expert: Linear(h, f) → GELU → Linear(f, h), the transformer's MLP."""

    def __init__(self, hidden: int, ffn: int, device=None, dtype=None):
        super().__init__()
        device = device if device is not None else rank_device()
        self.fc = nn.Linear(hidden, ffn, device=device, dtype=dtype)
        self.act = nn.GELU()
        self.proj = nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


def _drawn(shape, seed: int, dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64, device="cpu") / shape[-1] ** 0.5).to(device, dtype)


def make_experts(hidden: int, ffn: int, experts, seed: int = 0, device=None, dtype=torch.float32) -> nn.ModuleList:
    """Experts ``experts`` (ids, e.g. ``range(E)`` or one rank's block), expert j drawn from seed + 1 + j."""
    device = device if device is not None else rank_device()
    out = nn.ModuleList()
    for j in experts:
        mlp = ExpertMLP(hidden, ffn, device=device, dtype=dtype)
        with torch.no_grad():
            for i, p in enumerate(mlp.parameters()):
                p.copy_(_drawn(p.shape, 1_000 * (seed + 1 + j) + i, dtype, device))
        out.append(mlp)
    return out


def make_router_weight(hidden: int, num_experts: int, seed: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """The router's (E, h) weight, drawn from ``seed`` on the CPU and moved."""
    device = device if device is not None else rank_device()
    return _drawn((num_experts, hidden), 1_000 * seed + 999, dtype, device)


def local_expert_range(num_experts: int, group=None) -> range:
    """The expert ids this rank holds in ``group``: contiguous blocks of E/e."""
    r, e = group_info(group)
    check_moe_sizes(num_experts, 1, None, e)
    local = num_experts // e
    return range(r * local, (r + 1) * local)


def run_experts(expert_inputs: torch.Tensor, tokens_per_expert: list[int], experts) -> torch.Tensor:
    """Each local expert on its block of rows (an expert with no row runs on an empty block)."""
    if len(tokens_per_expert) != len(experts):
        raise ValueError(f"{len(tokens_per_expert)} blocks of rows for {len(experts)} experts")
    blocks = torch.split(expert_inputs, list(tokens_per_expert), dim=0)
    return torch.cat([expert(rows) for expert, rows in zip(experts, blocks)], dim=0)


def moe_layer(x: torch.Tensor, router_weight: torch.Tensor, experts, k: int, capacity_factor: float | None = None,
              group=None, return_routing: bool = False):
    """The MoE layer on this rank's tokens ``x`` (..., h) with its local ``experts`` (E/e of them).

    Returns y shaped like x (and the :class:`Routing`, with ``return_routing``)."""
    _, e = group_info(group)
    if router_weight.dim() != 2 or router_weight.shape[1] != x.shape[-1]:
        raise ValueError(f"router_weight must be (experts, hidden={x.shape[-1]}), got {tuple(router_weight.shape)}")
    num_experts = router_weight.shape[0]
    check_moe_sizes(num_experts, k, capacity_factor, e)
    if len(experts) != num_experts // e:
        raise ValueError(f"{len(experts)} local experts given; E={num_experts} over {e} ranks needs "
                         f"{num_experts // e} per rank")
    tokens = x.reshape(-1, x.shape[-1])
    routing = top_k_router(tokens @ router_weight.t(), k, capacity_factor)
    rows, plan = ep_dispatch(tokens, routing.indices, num_experts, routing.mask, group=group)
    outputs = run_experts(rows, plan.tokens_per_expert, experts)
    y = ep_combine(outputs, routing.weights, plan, group=group).reshape(x.shape)
    return (y, routing) if return_routing else y


class MoELayer(nn.Module):
    """A rank's share of an E-expert MoE layer over ``group`` (None: the whole world)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int = 2, capacity_factor: float | None = None,
                 group=None, *, balance_coef: float = 0.01, z_coef: float = 0.0, seed: int = 0, device=None,
                 dtype=torch.float32):
        super().__init__()
        _, e = group_info(group)
        check_moe_sizes(num_experts, k, capacity_factor, e)
        self.num_experts, self.k, self.capacity_factor, self.group = num_experts, k, capacity_factor, group
        self.balance_coef, self.z_coef = balance_coef, z_coef
        self.expert_ids = local_expert_range(num_experts, group)
        self.router = nn.Parameter(make_router_weight(hidden, num_experts, seed, device, dtype))
        self.experts = make_experts(hidden, ffn, self.expert_ids, seed, device, dtype)
        for p in self.experts.parameters():
            p.expert_parallel = True
        self.routing: Routing | None = None      # the last forward's, for inspection
        self.plan: DispatchPlan | None = None    # its dispatch (rows sent and received per rank, per expert)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`moe_layer`'s steps, keeping the routing and the dispatch plan; returns (y, aux loss)."""
        if x.shape[-1] != self.router.shape[1]:
            raise ValueError(f"tokens of hidden size {x.shape[-1]} for a layer of hidden size {self.router.shape[1]}")
        tokens = x.reshape(-1, x.shape[-1])
        logits = tokens @ self.router.t()
        self.routing = top_k_router(logits, self.k, self.capacity_factor)
        rows, self.plan = ep_dispatch(tokens, self.routing.indices, self.num_experts, self.routing.mask, self.group)
        outputs = run_experts(rows, self.plan.tokens_per_expert, self.experts)
        y = ep_combine(outputs, self.routing.weights, self.plan, self.group).reshape(x.shape)
        aux = (self.balance_coef * load_balancing_loss(self.routing.probs, self.routing.indices, self.num_experts)
               + self.z_coef * router_z_loss(logits))
        return y, aux
