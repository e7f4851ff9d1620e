"""Collective operations rebuilt from point-to-point ``send``/``recv``.

Every collective in ``torch.distributed`` can be written with nothing but
``isend``/``irecv``; this module does so, one readable function per primitive
(the all-reduce variants live in :mod:`minidist.allreduce`). Costs of each pattern
are in :mod:`minidist.cost`; the reference for the algorithms is Thakur, Rabenseifner
& Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005).

Conventions shared by every function here and in :mod:`minidist.allreduce`:

* ``group=None`` means the whole world; any other process group works the same way,
  ranks being *group* ranks (``dist.get_rank(group)``), so the functions run inside a
  sub-group of a device mesh.
* Inputs are never modified; a new tensor is returned.
* Data is chunked with ``tensor.tensor_split(n)`` along dim 0: chunk ``i`` goes to /
  is owned by group rank ``i``. It works for lengths not divisible by ``n`` and for
  lengths below ``n`` (some chunks are empty; empty messages are skipped on both sides,
  since both sides know the sizes: a zero-byte message would still cost a handshake).
* Bad input raises ``ValueError``/``TypeError`` *before* any message is sent, so one
  rank's mistake cannot leave its peers blocked in a receive.

Deadlock freedom. Under gloo ``isend``/``irecv`` progress in background threads, so any
order works. Under NCCL a point-to-point op is a kernel that waits for its partner,
and ops between the same two ranks run in order: if both ranks of a pair first post
``recv`` they wait forever. We therefore assume the strictest model -- every op
blocks until its partner posts the matching op -- and order each exchange so it
completes under it: in a pairwise exchange the lower rank sends first (see
:func:`exchange`); trees only ever send "down" or "up" the tree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.trace import api

__all__ = ["broadcast", "reduce", "scatter", "gather", "all_gather", "reduce_scatter",
           "all_to_all", "exchange", "group_info"]


# ----------------------------------------------------------------------------- helpers
def group_info(group=None) -> tuple[int, int]:
    """(group rank, group size), with a clear error if this rank is not in ``group``."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run inside minidist.launch(...) "
                           "or call minidist.init_from_env() first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group")
    return rank, dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    """Group rank -> global rank (what ``dst=``/``src=`` expect)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def check_tensor(tensor, name: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} has dtype {tensor.dtype}; sum reduction needs a real numeric dtype")


def check_root(root: int, n: int, name: str = "src") -> None:
    if not isinstance(root, int) or not 0 <= root < n:
        raise ValueError(f"{name}={root!r} is not a rank of a group of size {n}")


def _send(t, peer, group):
    return dist.isend(t, dst=global_rank(group, peer), group=group) if t.numel() else None


def _recv(t, peer, group):
    return dist.irecv(t, src=global_rank(group, peer), group=group) if t.numel() else None


def wait_all(works) -> None:
    for w in works:
        if w is not None:
            w.wait()


def exchange(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None,
             src: int | None, group=None) -> None:
    """Send ``send`` to group rank ``dst`` while receiving ``recv`` from ``src``.

    Both directions are posted before either is waited on (that is what lets a
    ring step send and receive at once). Order: when the partner in both directions
    is the same rank (a pairwise swap, or a 2-rank ring) the lower rank sends first
    and the higher one receives first, so the exchange completes even if ops block
    until matched (NCCL). With distinct partners (a ring with n > 2) even ranks send
    first and odd ranks receive first: then in every ring step some rank's first op
    meets its partner's first op (an even rank sending to an odd one), and the chain
    unwinds from there, for odd n too. tests/test_collectives.py runs every algorithm
    with isend/irecv made blocking to check exactly this.
    """
    me, _ = group_info(group)
    send_first = me < dst if (dst is not None and dst == src) else me % 2 == 0
    ops = []
    for step in ("send", "recv") if send_first else ("recv", "send"):
        if step == "send" and send is not None:
            ops.append(_send(send, dst, group))
        elif step == "recv" and recv is not None:
            ops.append(_recv(recv, src, group))
    wait_all(ops)


def _chunks(t: torch.Tensor, n: int):
    return t.tensor_split(n)


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
            wait_all([_recv(out, (v - mask + src) % n, group)])
            break
        mask <<= 1
    mask >>= 1                               # then send to children v + mask/2, v + mask/4, ...
    sends = []
    while mask > 0:
        if v + mask < n:
            sends.append(_send(out, (v + mask + src) % n, group))
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
            wait_all([_send(acc, (v - mask + dst) % n, group)])
            return None
        if v + mask < n:                     # add the child's subtree
            wait_all([_recv(buf, (v + mask + dst) % n, group)])
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
        chunks = _chunks(tensor.detach().contiguous(), n)
        wait_all([_send(c.contiguous(), i, group) for i, c in enumerate(chunks) if i != src])
        return chunks[me].clone()
    out = torch.empty_like(_chunks(tensor, n)[me], memory_format=torch.contiguous_format)
    wait_all([_recv(out, src, group)])
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
        wait_all([_send(mine, dst, group)])
        return None
    out = torch.empty((n * mine.shape[0],) + tuple(mine.shape[1:]) if mine.dim() else (n,),
                      dtype=mine.dtype)
    parts = _chunks(out, n)
    works = [_recv(p, i, group) for i, p in enumerate(parts) if i != me]
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
                      dtype=mine.dtype)
    parts = _chunks(out, n)
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
    chunks = _chunks(acc, n)
    right, left = (me + 1) % n, (me - 1) % n
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):
        out_c, in_c = chunks[(me - s - 1) % n], chunks[(me - s - 2) % n]
        incoming = buf[: in_c.shape[0]]
        exchange(out_c, right, incoming, left, group)
        in_c += incoming


def ring_all_gather_into(acc: torch.Tensor, me: int, n: int, group) -> None:
    """In place on ``acc``: rank r owns chunk r; afterwards every rank holds every chunk."""
    chunks = _chunks(acc, n)
    right, left = (me + 1) % n, (me - 1) % n
    for s in range(n - 1):
        exchange(chunks[(me - s) % n], right, chunks[(me - s - 1) % n], left, group)


@api("reduce_scatter")
def reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Ring reduce-scatter: rank r returns Σ_ranks chunk r of ``tensor.tensor_split(n)``.

    n-1 steps of S/n bytes: (n-1)(α + (S/n)β + (S/n)γ).
    """
    check_tensor(tensor)
    me, n = group_info(group)
    acc = tensor.detach().clone().contiguous()
    ring_reduce_scatter_into(acc, me, n, group)
    return _chunks(acc, n)[me].clone()


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
    mine = _chunks(tensor.detach().contiguous(), n)
    pieces = [torch.empty_like(mine[me], memory_format=torch.contiguous_format) for _ in range(n)]
    for k in range(n):
        p = (k - me) % n
        if p == me:
            pieces[me].copy_(mine[me])
        else:
            exchange(mine[p].contiguous(), p, pieces[p], p, group)
    return torch.cat(pieces)
