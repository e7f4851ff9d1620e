"""The one exchange of expert parallelism: rows to the ranks of a group in uneven splits, differentiable.

Lepikhin et al. 2021 ("GShard", Sec. 3.2: dispatch and combine are each one all-to-all);
the uneven splits of dropless MoE (Gale et al. 2023, "MegaBlocks"). Rank r sends
``send_splits[s]`` consecutive rows to group rank s and receives ``recv_splits[s]`` rows from
it, in group-rank order: one ``all_to_all_single``. Moving a row is a permutation of rows
across ranks, and the gradient of a permutation is its inverse: backward is the same exchange
with the splits swapped (what came from s goes back to s). :mod:`~minidist.expert_parallel.dispatch`
builds dispatch and combine on it (the regrouping by expert around it is plain indexing).

A group of one rank sends nothing. Every tensor made here is on the rows' device.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from minidist.collectives.p2p import group_info

__all__ = ["AllToAllRows", "all_to_all_rows"]


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """One uneven all-to-all of rows (no autograd): send[s] rows to group rank s, recv[s] rows from it."""
    out = torch.empty((sum(recv),) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class AllToAllRows(torch.autograd.Function):
    """Forward: ``send_splits[s]`` rows to group rank s. Backward: the gradients home (splits swapped)."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (list(send_splits), list(recv_splits)), group
        return _exchange(rows, list(send_splits), list(recv_splits), group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_rows(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                    group=None) -> torch.Tensor:
    """Rows (A, ...) out in ``send_splits`` (one per group rank, summing to A), rows (R, ...) in,
    ``recv_splits[s]`` from group rank s, in group-rank order. Differentiable. A group of one
    returns ``rows`` as they are."""
    _, e = group_info(group)
    send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
    if len(send) != e or len(recv) != e or min(send + recv) < 0:
        raise ValueError(f"send and receive splits must be {e} counts >= 0 (one per group rank), got {send}, {recv}")
    if sum(send) != rows.shape[0]:
        raise ValueError(f"send splits {send} add up to {sum(send)} rows, the rows given are {rows.shape[0]}")
    if e == 1:
        if recv != send:
            raise ValueError(f"a group of one receives what it sends: got send {send}, receive {recv}")
        return rows
    return AllToAllRows.apply(rows, send, recv, group)
