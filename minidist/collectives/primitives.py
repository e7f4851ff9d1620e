"""Collective operations rebuilt from point-to-point ``send``/``recv``.

Every collective in ``torch.distributed`` can be written with nothing but
``isend``/``irecv``; this module does so, one readable function per primitive
(the all-reduce variants live in :mod:`minidist.collectives.allreduce`). Costs of each
pattern are in :mod:`minidist.cost.collectives`; the reference for the algorithms is
Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005). Conventions (groups, chunking, errors before communication,
deadlock freedom under NCCL semantics) are those of :mod:`minidist.collectives.p2p`.
"""
from __future__ import annotations

import torch

from minidist.collectives.p2p import (check_root, check_tensor, chunks, exchange, group_info, recv_from,
                                      send_to, wait_all)
from minidist.trace import api

__all__ = ["broadcast", "reduce", "scatter", "gather", "all_gather", "reduce_scatter", "all_to_all",
           "ring_reduce_scatter_into", "ring_all_gather_into"]


# ----------------------------------------------------------------------------- one-to-many
@api("broadcast")
def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Binomial-tree broadcast from group rank ``src``: ⌈lg n⌉ rounds.

    Every rank passes a tensor of the same shape and dtype (only ``src``'s values are
    used) and gets a copy of ``src``'s tensor. Round k: every rank that already has the
    data (relative rank v < 2^k) sends it to v + 2^k. Cost: ⌈lg n⌉(α + Sβ).
    """
    check_tensor(tensor)
    me, n = group_info(group)
    check_root(src, n)
    out = tensor.detach().clone().contiguous()
    v = (me - src) % n                       # rank relative to the root
    mask = 1
    while mask < n:                          # receive once, from the parent v - highest bit
        if v & mask:
            wait_all([recv_from(out, (v - mask + src) % n, group)])
            break
        mask <<= 1
    mask >>= 1                               # then send to children v + mask/2, v + mask/4, ...
    sends = []
    while mask > 0:
        if v + mask < n:
            sends.append(send_to(out, (v + mask + src) % n, group))
        mask >>= 1
    wait_all(sends)
    return out


@api("reduce")
def reduce(tensor: torch.Tensor, dst: int = 0, group=None) -> torch.Tensor | None:
    """Binomial-tree sum to group rank ``dst`` (the broadcast tree run backwards).

    Returns the sum on ``dst`` and ``None`` elsewhere. Cost: ⌈lg n⌉(α + Sβ + Sγ).
    """
    check_tensor(tensor)
    me, n = group_info(group)
    check_root(dst, n, "dst")
    acc = tensor.detach().clone().contiguous()
    buf = torch.empty_like(acc)
    v = (me - dst) % n
    mask = 1
    while mask < n:
        if v & mask:                         # my subtree is summed: hand it to the parent
            wait_all([send_to(acc, (v - mask + dst) % n, group)])
            return None
        if v + mask < n:                     # add the child's subtree
            wait_all([recv_from(buf, (v + mask + dst) % n, group)])
            acc += buf
        mask <<= 1
    return acc


@api("scatter")
def scatter(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Rank i gets chunk i of ``src``'s ``tensor.tensor_split(n)``.

    Every rank passes a tensor of the same shape (non-root values are ignored; the
    shape tells each rank the size of its chunk). Linear: the root sends n-1 chunks,
    (n-1)(α + Sβ/n) on the root's link.
    """
    check_tensor(tensor)
    me, n = group_info(group)
    check_root(src, n)
    if me == src:
        pieces = chunks(tensor.detach().contiguous(), n)
        wait_all([send_to(c.contiguous(), i, group) for i, c in enumerate(pieces) if i != src])
        return pieces[me].clone()
    out = torch.empty_like(chunks(tensor, n)[me], memory_format=torch.contiguous_format)
    wait_all([recv_from(out, src, group)])
    return out


@api("gather")
def gather(tensor: torch.Tensor, dst: int = 0, group=None) -> torch.Tensor | None:
    """``dst`` returns ``torch.cat`` of every rank's tensor (same shape on all ranks);
    the others return ``None``. Linear: (n-1)(α + Sβ) on the root's link."""
    check_tensor(tensor)
    me, n = group_info(group)
    check_root(dst, n, "dst")
    mine = tensor.detach().contiguous()
    if me != dst:
        wait_all([send_to(mine, dst, group)])
        return None
    out = torch.empty((n * mine.shape[0],) + tuple(mine.shape[1:]) if mine.dim() else (n,),
                      dtype=mine.dtype, device=mine.device)
    parts = chunks(out, n)
    works = [recv_from(p, i, group) for i, p in enumerate(parts) if i != me]
    parts[me].copy_(mine.reshape(parts[me].shape))
    wait_all(works)
    return out


# ----------------------------------------------------------------------------- many-to-many
@api("all_gather")
def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Ring all-gather: every rank returns ``torch.cat`` of all ranks' tensors.

    Step s: send the piece received in step s-1 (own piece first) to the right,
    receive a new one from the left. n-1 steps; each rank sends (n-1)·S bytes
    where S is one rank's piece: (n-1)(α + Sβ).
    """
    check_tensor(tensor)
    me, n = group_info(group)
    mine = tensor.detach().contiguous()
    out = torch.empty((n * mine.shape[0],) + tuple(mine.shape[1:]) if mine.dim() else (n,),
                      dtype=mine.dtype, device=mine.device)
    parts = chunks(out, n)
    parts[me].copy_(mine.reshape(parts[me].shape))
    right, left = (me + 1) % n, (me - 1) % n
    for s in range(n - 1):
        exchange(parts[(me - s) % n], right, parts[(me - s - 1) % n], left, group)
    return out


def ring_reduce_scatter_into(acc: torch.Tensor, me: int, n: int, group) -> None:
    """In place on ``acc`` (contiguous): afterwards chunk ``me`` holds the sum over ranks.

    Step s: send chunk (me-s-1) to the right, receive chunk (me-s-2) from the left and
    add it to mine. After n-1 steps the chunk that arrives is chunk ``me``, which has
    then passed through every rank. Shared by :func:`reduce_scatter` and the ring all-reduce.
    """
    parts = chunks(acc, n)
    right, left = (me + 1) % n, (me - 1) % n
    buf = torch.empty_like(parts[0])
    for s in range(n - 1):
        out_c, in_c = parts[(me - s - 1) % n], parts[(me - s - 2) % n]
        incoming = buf[: in_c.shape[0]]
        exchange(out_c, right, incoming, left, group)
        in_c += incoming


def ring_all_gather_into(acc: torch.Tensor, me: int, n: int, group) -> None:
    """In place on ``acc``: rank r owns chunk r; afterwards every rank holds every chunk."""
    parts = chunks(acc, n)
    right, left = (me + 1) % n, (me - 1) % n
    for s in range(n - 1):
        exchange(parts[(me - s) % n], right, parts[(me - s - 1) % n], left, group)


@api("reduce_scatter")
def reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Ring reduce-scatter: rank r returns Σ_ranks chunk r of ``tensor.tensor_split(n)``.

    n-1 steps of S/n bytes: (n-1)(α + (S/n)β + (S/n)γ).
    """
    check_tensor(tensor)
    me, n = group_info(group)
    acc = tensor.detach().clone().contiguous()
    ring_reduce_scatter_into(acc, me, n, group)
    return chunks(acc, n)[me].clone()


@api("all_to_all")
def all_to_all(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Rank r sends chunk j of its ``tensor.tensor_split(n)`` to rank j and returns the
    chunks it received, concatenated in source-rank order (same shape on every rank).

    Pairwise exchange: in step k, rank r swaps with p = (k - r) mod n, a perfect pairing
    (p's partner is r), so every step is a set of independent swaps, ordered with
    :func:`exchange`; over k = 0..n-1 every pair meets once. (n-1)(α + (S/n)β).
    """
    check_tensor(tensor)
    me, n = group_info(group)
    mine = chunks(tensor.detach().contiguous(), n)
    pieces = [torch.empty_like(mine[me], memory_format=torch.contiguous_format) for _ in range(n)]
    for k in range(n):
        p = (k - me) % n
        if p == me:
            pieces[me].copy_(mine[me])
        else:
            exchange(mine[p].contiguous(), p, pieces[p], p, group)
    return torch.cat(pieces)
