"""The two ring schedules that hide a collective behind the computation it feeds (or is fed by).

Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models" (ASPLOS): an all-gather whose result a matmul consumes, or a
reduce-scatter of a matmul's output, is cut into t point-to-point steps around a ring of the
t ranks, and each step's matmul runs while the next step's message travels. Only what no
matmul covers stays exposed: per step, max(0, T_message - T_matmul).

* :func:`ring_all_gather_consume`: rank r starts with its own shard; at step s it holds shard
  (r - s) mod t, passes it to its right neighbour, receives the next one from its left, and
  meanwhile ``consume``\\ s the one it holds. t - 1 messages of one shard each: the bytes of a
  ring all-gather, (t - 1)·|shard| per rank.
* :func:`ring_reduce_scatter_produce`: the accumulator of output chunk c starts at rank c + 1
  and travels the ring, each rank adding its own contribution, until it ends at rank c. Rank r
  ``produce``\\ s its contribution to the chunk the next step needs while the accumulator it
  just sent travels: t - 1 messages of one chunk, a ring reduce-scatter's bytes.

Messages go through :func:`minidist.collectives.p2p.post_exchange` (both directions posted
before either is waited on, in the order that completes even when every op blocks until its
partner posts, as NCCL's may). Each ``consume``/``produce`` call is recorded as
``compute("matmul", chunk=c, step=s)`` in an open ``minidist.trace``, so a timeline shows each
message issued before the matmul it overlaps.
"""
from __future__ import annotations

from typing import Callable

import torch

from minidist.collectives.p2p import group_info, post_exchange, wait_all
from minidist.trace import compute

__all__ = ["ring_all_gather_consume", "ring_reduce_scatter_produce", "neighbours"]


def neighbours(group=None) -> tuple[int, int, int, int]:
    """(my group rank, group size, right neighbour, left neighbour) on the ring of the group's ranks."""
    me, t = group_info(group)
    return me, t, (me + 1) % t, (me - 1) % t


def ring_all_gather_consume(shard: torch.Tensor, consume: Callable[[int, torch.Tensor], None], group=None,
                            name: str = "matmul") -> None:
    """Call ``consume(c, shard_c)`` once for every group rank c's ``shard`` (all the same shape),
    own shard first, each call overlapping the transfer of the next shard."""
    me, t, right, left = neighbours(group)
    held = shard.contiguous()
    for step in range(t):
        works, arriving = [], None
        if step < t - 1:            # pass what I hold on, receive what comes next, before computing
            arriving = torch.empty_like(held)
            works = post_exchange(held, right, arriving, left, group)
        with compute(name, chunk=(me - step) % t, step=step):
            consume((me - step) % t, held)
        wait_all(works)
        if arriving is not None:
            held = arriving


def ring_reduce_scatter_produce(produce: Callable[[int], torch.Tensor], group=None,
                                name: str = "matmul") -> torch.Tensor:
    """The sum over the group's ranks of ``produce(c)`` for c = my group rank, where every rank's
    ``produce(c)`` returns its contribution to output chunk c (same shape on every rank); each
    contribution is computed while the previous accumulator travels."""
    me, t, right, left = neighbours(group)
    with compute(name, chunk=(me - 1) % t, step=0):
        acc = produce((me - 1) % t).contiguous()
    for step in range(1, t):
        chunk = (me - 1 - step) % t         # the chunk whose accumulator arrives from the left now
        arriving = torch.empty_like(acc)
        works = post_exchange(acc, right, arriving, left, group)
        with compute(name, chunk=chunk, step=step):
            mine = produce(chunk)
        wait_all(works)
        acc = arriving + mine
    return acc
