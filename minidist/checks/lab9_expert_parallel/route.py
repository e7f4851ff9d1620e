"""Lab 9's ``Route``: what the notebook's ``ep_dispatch`` returns for its ``ep_combine`` (handed out, a type).

The lab's contract: a (token, choice) pair is numbered ``token·k + choice``; a rank sends its kept
pairs sorted by expert (token order within an expert); its experts receive rows grouped by local
expert, then by source rank, then in token order. :class:`minidist.expert_parallel.DispatchPlan`
holds the same three things under the library's names (``pairs``, ``send_counts``,
``recv_counts``): :func:`route_of` reads them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Route(NamedTuple):
    """What ``ep_combine`` needs to undo ``ep_dispatch`` (int64 tensors on the tokens' device)."""
    order: torch.Tensor         # (s,): the pairs this rank sent, token·k + choice, in the order sent
    send_counts: torch.Tensor   # (E,): rows this rank sent to each expert
    recv_counts: torch.Tensor   # (e, E/e): rows received from each group rank, for each local expert


def route_of(plan) -> Route:
    """The lab's Route of a :class:`minidist.expert_parallel.DispatchPlan` (the same tensors)."""
    return Route(plan.pairs, plan.send_counts, plan.recv_counts)
