"""Point-to-point building blocks shared by every collective in this package.

Conventions shared by every function of :mod:`minidist.collectives`:

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

__all__ = ["group_info", "global_rank", "check_tensor", "check_root", "send_to", "recv_from", "wait_all",
           "exchange", "post_exchange", "chunks"]


def group_info(group=None) -> tuple[int, int]:
    """(group rank, group size), with a clear error if this rank is not in ``group``.

    The one place every minidist technique asks "who am I in this group?", so each fails
    the same way, before any message, when called outside a launched rank."""
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


def send_to(t, peer, group):
    return dist.isend(t, dst=global_rank(group, peer), group=group) if t.numel() else None


def recv_from(t, peer, group):
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
    wait_all(post_exchange(send, dst, recv, src, group))


def post_exchange(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None,
                  src: int | None, group=None) -> list:
    """:func:`exchange` without the wait: the works, posted in the same deadlock-free
    order, so the caller can compute while the messages travel and wait afterwards."""
    me, _ = group_info(group)
    send_first = me < dst if (dst is not None and dst == src) else me % 2 == 0
    ops = []
    for step in ("send", "recv") if send_first else ("recv", "send"):
        if step == "send" and send is not None:
            ops.append(send_to(send, dst, group))
        elif step == "recv" and recv is not None:
            ops.append(recv_from(recv, src, group))
    return ops


def chunks(t: torch.Tensor, n: int):
    """The chunking every collective uses: chunk i goes to / is owned by group rank i."""
    return t.tensor_split(n)
