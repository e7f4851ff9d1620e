"""The DP × EP training loop: a tiny MoE model trained on a (dp, ep) mesh, and the same on one process.

The model (:class:`TinyMoE`): a dense Linear(h, h), then a :class:`~minidist.expert_parallel.MoELayer`
with a residual, z = Wx + b, out = z + MoE(z); loss = MSE(out, target) + the layer's aux loss
(balance_coef · L_balance + z_coef · L_z). Every rank reads its block of T tokens of the
global batch (n·T tokens, n = dp·ep ranks), the MoE's experts are sharded over the EP
group, and after backward :func:`~minidist.expert_parallel.sync_moe_gradients` averages
the dense gradients over all n ranks and the experts' over their d replicas; then SGD.

One process (:func:`reference_train`) holds all E experts, routes the n blocks of the
global batch each on its own (:func:`~minidist.expert_parallel.moe_reference`, ``groups=n``:
capacity is per rank under EP), and minimises the mean of the n blocks' losses: the same
numbers, so parameters after every step must agree to rounding.

:func:`train_dp_ep` runs inside a rank and returns per-step global losses, this rank's
parameters under their global names (expert j as ``moe.experts.j.*``) and the last step's
traced all-to-all and all-reduce payloads. Everything lives on ``minidist.device()``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.cost.expert_parallel import ep_collectives
from minidist.expert_parallel import (MoELayer, load_balancing_loss, make_experts, make_router_weight, moe_reference,
                                      new_ep_dp_groups, router_z_loss, sync_moe_gradients)
from minidist.runtime import device as rank_device
from minidist.trace import trace

__all__ = ["MoECase", "TinyMoE", "moe_batch", "train_dp_ep", "expected_traffic", "reference_train",
           "max_param_error"]


@dataclass(frozen=True)
class MoECase:
    hidden: int = 8
    ffn: int = 16
    num_experts: int = 4
    k: int = 2
    capacity_factor: float | None = None
    tokens: int = 6                 # per rank
    steps: int = 2
    lr: float = 0.1
    balance_coef: float = 0.01
    z_coef: float = 0.001
    dtype: torch.dtype = torch.float64
    seed: int = 0


def _dense(case: MoECase, device) -> nn.Linear:
    lin = nn.Linear(case.hidden, case.hidden, device=device, dtype=case.dtype)
    g = torch.Generator().manual_seed(case.seed + 77)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64, device="cpu").to(device, case.dtype) * 0.5)
    return lin


class TinyMoE(nn.Module):
    """A dense Linear, then a MoE layer with a residual; forward returns (out, aux loss)."""

    def __init__(self, case: MoECase, group=None, device=None):
        super().__init__()
        device = device if device is not None else rank_device()
        self.inp = _dense(case, device)
        self.moe = MoELayer(case.hidden, case.ffn, case.num_experts, case.k, case.capacity_factor, group,
                            balance_coef=case.balance_coef, z_coef=case.z_coef, seed=case.seed, device=device,
                            dtype=case.dtype)

    def forward(self, x):
        z = self.inp(x)
        y, aux = self.moe(z)
        return z + y, aux


def moe_batch(case: MoECase, step: int, world_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (n·T, h) inputs and targets, drawn on the CPU and moved."""
    device = device if device is not None else rank_device()
    g = torch.Generator().manual_seed(1000 * case.seed + step)
    x, y = (torch.randn(world_size * case.tokens, case.hidden, generator=g, dtype=torch.float64, device="cpu")
            for _ in range(2))
    return x.to(device, case.dtype), y.to(device, case.dtype)


def _named(model: TinyMoE) -> dict[str, torch.Tensor]:
    """This rank's parameters under global names (local expert l is expert first + l)."""
    out = {}
    first = model.moe.expert_ids.start
    for name, p in model.named_parameters():
        if name.startswith("moe.experts."):
            _, _, local, rest = name.split(".", 3)
            name = f"moe.experts.{first + int(local)}.{rest}"
        out[name] = p.detach().cpu().clone()
    return out


def expected_traffic(case: MoECase, ep: int, world_size: int, rows: tuple[int, int]) -> list[tuple[str, int, int]]:
    """The last step's traffic by the cost model, sorted as ``train_dp_ep`` returns it: one flat
    all-reduce of the dense gradients over every rank, one of this rank's experts over the d
    replicas (when d > 1), and ``cost.ep_collectives`` for the rows this rank sent and received."""
    elem = torch.finfo(case.dtype).bits // 8
    h, f, n_exp = case.hidden, case.ffn, case.num_experts
    dense = (h * h + h + n_exp * h) * elem
    experts = n_exp // ep * (2 * h * f + f + h) * elem
    dp = world_size // ep
    out = [("all_reduce", world_size, dense)] if world_size > 1 else []
    out += [("all_reduce", dp, experts)] if dp > 1 else []
    out += [(c.op, ep, c.nbytes) for c in ep_collectives(*rows, h, n_exp, ep, elem)]
    return sorted(out)


def train_dp_ep(case: MoECase, ep: int, group=None) -> dict:
    """Inside a rank: ``case.steps`` SGD steps on the (n/ep, ep) mesh over ``group`` (None: the world).

    Returns ``losses`` (the global mean loss per step, on every rank), ``params`` (see the
    module docstring), ``traffic`` (the last step's (op, group size, payload bytes), sorted; the loss report
    is not in it), ``rows`` (the last step's rows sent and received by the dispatch: the all-to-alls'
    sizes, ``cost.ep_collectives``)."""
    rank, n = group_info(group)
    ep_group, edp_group = new_ep_dp_groups(ep, group)
    model = TinyMoE(case, ep_group)
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    losses = []
    for step in range(case.steps):
        x, target = moe_batch(case, step, n)
        mine = slice(rank * case.tokens, (rank + 1) * case.tokens)
        with trace() as t:
            out, aux = model(x[mine])
            loss = torch.nn.functional.mse_loss(out, target[mine]) + aux
            opt.zero_grad()
            loss.backward()
            sync_moe_gradients(model, edp_group, group)
        opt.step()
        total = loss.detach().clone()
        if n > 1:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / n)
    traffic = sorted((e.op, len(e.group) if e.group is not None else dist.get_world_size(), e.nbytes)
                     for e in t.comm())
    rows = (sum(model.moe.plan.send_splits), sum(model.moe.plan.recv_splits))
    return {"losses": losses, "params": _named(model), "traffic": traffic, "rows": rows}


def reference_train(case: MoECase, world_size: int, device=None) -> dict:
    """One process, all E experts, the global batch of ``world_size`` blocks: ``losses`` and ``params``."""
    device = device if device is not None else rank_device()
    inp = _dense(case, device)
    router = nn.Parameter(make_router_weight(case.hidden, case.num_experts, case.seed, device, case.dtype))
    experts = make_experts(case.hidden, case.ffn, range(case.num_experts), case.seed, device, case.dtype)
    params = [*inp.parameters(), router, *experts.parameters()]
    opt = torch.optim.SGD(params, lr=case.lr)
    losses = []
    for step in range(case.steps):
        x, target = moe_batch(case, step, world_size, device)
        z = inp(x)
        y, routings = moe_reference(z, router, experts, case.k, case.capacity_factor, groups=world_size)
        out = z + y
        loss = 0
        for r, routing in enumerate(routings):
            block = slice(r * case.tokens, (r + 1) * case.tokens)
            logits = z[block] @ router.t()
            loss = loss + (torch.nn.functional.mse_loss(out[block], target[block])
                           + case.balance_coef * load_balancing_loss(routing.probs, routing.indices, case.num_experts)
                           + case.z_coef * router_z_loss(logits))
        loss = loss / world_size
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    named = {f"inp.{n}": p for n, p in inp.named_parameters()} | {"moe.router": router}
    named |= {f"moe.experts.{n}": p for n, p in experts.named_parameters()}
    return {"losses": losses, "params": {n: p.detach().cpu().clone() for n, p in named.items()}}


def max_param_error(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Max |ours − reference| over the parameters a rank holds (every name must be in the reference)."""
    missing = sorted(set(ours) - set(reference))
    if missing:
        raise ValueError(f"parameters with no reference: {missing}")
    return max((ours[n].double() - reference[n].double()).abs().max().item() for n in ours)
