"""A whole expert-parallel group's dispatch computed in one process, from every rank's expert choices.

What :func:`~minidist.expert_parallel.dispatch.ep_dispatch` does on e ranks, without ranks:
every group rank's :class:`~minidist.expert_parallel.dispatch.DispatchPlan` (the counts
exchange of step 2 is a transpose of the e count vectors here) and, for each row a rank's
experts receive, where it came from: the source group rank and the (token, choice) pair there,
numbered token·k + choice. Rows arrive source by source, each source's in its send order, and
are regrouped by the plan's ``order``, as on the ranks. So a check or a test knows, for any
routing of any group, the exact rows and counts every rank must see, as the pipeline simulator
(:mod:`minidist.pipeline.simulator`) knows a schedule's timeline.

Every tensor made here is on the expert indices' device.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from minidist.expert_parallel.dispatch import DispatchPlan, check_indices, sorted_pairs

__all__ = ["SimulatedDispatch", "simulate_dispatch"]


class SimulatedDispatch(NamedTuple):
    plan: DispatchPlan          # what ep_dispatch returns on this group rank
    source: torch.Tensor        # (R,) int64: the group rank each received row comes from, in the returned order
    pair: torch.Tensor          # (R,) int64: that row's (token, choice) pair on its source, token·k + choice


def simulate_dispatch(expert_indices: list, num_experts: int, masks: list | None = None) -> list[SimulatedDispatch]:
    """For every group rank s (``expert_indices[s]``: its (T_s, k) choices, ``masks[s]`` its kept
    pairs or None), what :func:`ep_dispatch` gives it in a group of ``len(expert_indices)`` ranks."""
    e = len(expert_indices)
    if e < 1:
        raise ValueError("simulate_dispatch needs the expert indices of at least one rank")
    masks = [None] * e if masks is None else list(masks)
    if len(masks) != e:
        raise ValueError(f"{len(masks)} masks for {e} ranks' expert indices")
    for idx, mask in zip(expert_indices, masks):
        check_indices(idx, num_experts, mask, e)
    if len({idx.shape[1] for idx in expert_indices}) > 1:
        raise ValueError(f"every rank chooses the same k experts per token, got {[i.shape[1] for i in expert_indices]}")
    local = num_experts // e
    sent = [sorted_pairs(idx, num_experts, mask) for idx, mask in zip(expert_indices, masks)]
    plans = [DispatchPlan(sent[r][0], idx.shape[1], sent[r][1],
                          torch.stack([counts[r * local:(r + 1) * local] for _, counts in sent]), idx.shape[0])
             for r, idx in enumerate(expert_indices)]
    out = []
    for r, plan in enumerate(plans):
        source, pair = [], []
        for s, other in enumerate(plans):          # source s's rows for rank r: its r-th block of send order
            start = sum(other.send_splits[:r])
            pair.append(other.pairs[start:start + other.send_splits[r]])
            source.append(torch.full((other.send_splits[r],), s, dtype=torch.int64, device=other.pairs.device))
        out.append(SimulatedDispatch(plan, torch.cat(source)[plan.order], torch.cat(pair)[plan.order]))
    return out
