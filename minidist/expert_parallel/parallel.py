"""Expert parallelism × data parallelism on one mesh: who holds what, whose gradients are summed where.

Lepikhin et al. 2021 ("GShard", Sec. 3.2); Rajbhandari et al. 2022 ("DeepSpeed-MoE",
Sec. 5: expert-parallel and expert-data-parallel groups). n = d·e ranks as a (dp, ep)
mesh, EP innermost: the EP groups are blocks of e consecutive ranks (the all-to-all stays
on the fast links of a node when e fits in one), and the ranks with the same EP
coordinate form the *expert-data-parallel* group (d ranks, stride e) that holds the same
experts.

Every rank reads its own micro-batch (the global batch cut n ways), so the dense
parameters (the router, the layers around the MoE) are plain data parallelism over all n
ranks. An expert's gradient on its rank already sums the contributions of every token of
its EP group that chose it (combine's backward brought them there), so it only needs the
sum over the d replicas of that expert. With the loss the mean of the n ranks' local
losses, both are then divided by n:

    dense:   g ← (1/n) · all_reduce(g, every rank)
    expert:  g ← (1/n) · all_reduce(g, expert-data-parallel group of d ranks)

Traffic per rank per step (ring): 2(n−1)/n · dense bytes + 2(d−1)/d · local expert bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.collectives.p2p import group_info

__all__ = ["ep_dp_groups", "new_ep_dp_groups", "expert_parameters", "dense_parameters", "sync_moe_gradients"]


def ep_dp_groups(world_size: int, ep: int) -> dict[str, list[list[int]]]:
    """The (dp, ep) mesh's groups as rank lists: {"ep": blocks of e consecutive ranks,
    "dp": the ranks sharing an EP coordinate (stride e)}. Pure arithmetic."""
    if not isinstance(ep, int) or ep < 1 or world_size % ep:
        raise ValueError(f"an expert-parallel size of {ep!r} does not divide {world_size} ranks")
    dp = world_size // ep
    return {"ep": [list(range(i * ep, (i + 1) * ep)) for i in range(dp)],
            "dp": [list(range(j, world_size, ep)) for j in range(ep)]}


def new_ep_dp_groups(ep: int, group=None):
    """Inside a rank: (ep_group, expert_dp_group) of this rank on the (dp, ep) mesh over ``group``
    (None: the world). A group spanning all of ``group`` is ``group`` itself; every rank
    creates every other group, as ``dist.new_group`` requires."""
    rank, n = group_info(group)
    layout = ep_dp_groups(n, ep)
    members = list(range(n)) if group is None else dist.get_process_group_ranks(group)
    mine = {}
    for axis in ("ep", "dp"):
        for ranks in layout[axis]:
            if len(ranks) == n:
                made = group
            else:
                made = dist.new_group([members[i] for i in ranks])
            if rank in ranks:
                mine[axis] = made
    return mine["ep"], mine["dp"]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters marked ``expert_parallel`` (a rank's experts; see :class:`MoELayer`)."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", False)]


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Every other parameter: replicated on all ranks."""
    return [p for p in module.parameters() if not getattr(p, "expert_parallel", False)]


def _all_reduce_mean(params: list[nn.Parameter], group, n: int) -> None:
    """One flat all-reduce of the params' gradients over ``group`` (missing ones count as zeros), / n."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group_info(group)[1] > 1:
        dist.all_reduce(flat, group=group)
    flat /= n
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.grad = chunk.view_as(p).clone()


def sync_moe_gradients(module: nn.Module, expert_dp_group, group=None) -> None:
    """After backward: dense gradients averaged over ``group`` (None: the world, every rank
    of the mesh), expert gradients summed over ``expert_dp_group`` and divided by the same n."""
    _, n = group_info(group)
    _, d = group_info(expert_dp_group)
    if n % d:
        raise ValueError(f"the expert-data-parallel group ({d} ranks) does not divide the mesh ({n} ranks)")
    _all_reduce_mean(dense_parameters(module), group, n)
    _all_reduce_mean(expert_parameters(module), expert_dp_group, n)
