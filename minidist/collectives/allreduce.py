"""All-reduce, every variant of the "Communication Primitives" lecture, from send/recv.

All-reduce: every rank holds a tensor of the same shape and gets back their sum.
Variants, with their α-β-γ costs (S bytes per rank, n ranks; formulas in
:mod:`minidist.cost`, table in :func:`minidist.cost.allreduce_table`):

=====================  ======================================  =========================
parameter server       everyone pushes to a server at once,    server link carries 2(n-1)S
                       server sums, everyone pulls
naive (sequential)     reduce to rank 0 one rank at a time,    2(n-1) steps of S
                       then broadcast one rank at a time
naive parallel         everyone sends everything to everyone   n(n-1)S on the wire
ring                   reduce-scatter + all-gather on a ring   2(n-1)/n·S per rank
recursive halving      Rabenseifner: reduce-scatter by         2 lg n steps, 2(n-1)/n·S
                       halving, all-gather by doubling
tree                   binomial reduce, binomial broadcast     2⌈lg n⌉ steps of S
=====================  ======================================  =========================

The ring is the Patarasuk & Yuan (2009) bandwidth-optimal all-reduce; recursive halving
and doubling is Rabenseifner's algorithm as analysed in Thakur, Rabenseifner & Gropp
(2005). :func:`fast_ring_all_reduce` is the same ring, pipelined the way NCCL runs it.
Conventions (group, chunking, errors-before-communication, deadlock freedom) are those
of :mod:`minidist.collectives.p2p`.
"""
from __future__ import annotations

import torch

from minidist.collectives.p2p import check_tensor, exchange, group_info, recv_from, send_to, wait_all
from minidist.collectives.primitives import broadcast, reduce, ring_all_gather_into, ring_reduce_scatter_into
from minidist.trace import api

__all__ = ["parameter_server_all_reduce", "naive_all_reduce", "parallel_all_reduce",
           "tree_all_reduce", "ring_all_reduce", "recursive_halving_all_reduce",
           "fast_ring_all_reduce", "ALL_REDUCES"]


def _prepare(tensor, group):
    """Validate, then a flat contiguous private copy: the algorithms add into it in place."""
    check_tensor(tensor)
    me, n = group_info(group)
    return me, n, tensor.detach().reshape(-1).clone()


@api("parameter_server_all_reduce")
def parameter_server_all_reduce(tensor: torch.Tensor, server: int = 0, group=None) -> torch.Tensor:
    """Parameter server (Li et al., OSDI 2014), with group rank ``server`` as the server.

    Push: every worker sends its whole tensor to the server at once; the server sums
    (in rank order, so the result is deterministic). Pull: the server sends the sum to
    every worker at once. Two communication rounds, but all 2(n-1)S bytes cross the
    server's link: T = 2(α + (n-1)Sβ) + (n-1)Sγ on a single-port server.
    """
    me, n, acc = _prepare(tensor, group)
    if not isinstance(server, int) or not 0 <= server < n:
        raise ValueError(f"server={server!r} is not a rank of a group of size {n}")
    if me != server:
        wait_all([send_to(acc, server, group)])
        wait_all([recv_from(acc, server, group)])
        return acc.view(tensor.shape)
    inbox = {r: torch.empty_like(acc) for r in range(n) if r != me}
    wait_all([recv_from(buf, r, group) for r, buf in inbox.items()])      # all pushes in flight at once
    total = torch.zeros_like(acc)
    for r in range(n):
        total += acc if r == me else inbox[r]
    wait_all([send_to(total, r, group) for r in range(n) if r != me])   # all pulls at once
    return total.view(tensor.shape)


@api("naive_all_reduce")
def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Naive sequential all-reduce: reduce to rank 0, then broadcast from rank 0,
    one peer at a time.

    Rank 0 receives from ranks 1, 2, ..., n-1 in turn and adds, then sends the sum to
    1, 2, ..., n-1 in turn. Every byte passes through rank 0, and nothing overlaps:
    T = 2(n-1)(α + Sβ) + (n-1)Sγ.
    """
    me, n, acc = _prepare(tensor, group)
    if me != 0:
        wait_all([send_to(acc, 0, group)])
        wait_all([recv_from(acc, 0, group)])
        return acc.view(tensor.shape)
    buf = torch.empty_like(acc)
    for r in range(1, n):
        wait_all([recv_from(buf, r, group)])
        acc += buf
    for r in range(1, n):
        wait_all([send_to(acc, r, group)])
    return acc.view(tensor.shape)


@api("parallel_all_reduce")
def parallel_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Naive parallel all-reduce: every rank sends its whole tensor to every other rank
    and sums what it receives. One round (T = α + (n-1)Sβ + (n-1)Sγ on a single port,
    α + Sβ if every link runs at once) but n(n-1)S bytes in total and (n-1)S per node.

    Summing in rank order, not arrival order, makes every rank's result bit-identical.
    Ordering: for each peer p, the pair (me, p) uses :func:`exchange`-style lower-sends-first.
    """
    me, n, acc = _prepare(tensor, group)
    inbox = {r: torch.empty_like(acc) for r in range(n) if r != me}
    works = []
    for r in range(n):       # one pass in rank order; for each pair the lower rank sends first
        if r == me:
            continue
        first, second = (send_to(acc, r, group), recv_from(inbox[r], r, group)) if me < r else \
                        (recv_from(inbox[r], r, group), send_to(acc, r, group))
        works += [first, second]
    wait_all(works)
    total = torch.zeros_like(acc)
    for r in range(n):
        total += acc if r == me else inbox[r]
    return total.view(tensor.shape)


@api("tree_all_reduce")
def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Binomial-tree reduce to rank 0 followed by a binomial-tree broadcast:
    2⌈lg n⌉(α + Sβ) + ⌈lg n⌉Sγ. Latency-optimal-ish, bandwidth-poor (every step moves S)."""
    me, n, acc = _prepare(tensor, group)
    total = reduce(acc, 0, group)
    return broadcast(total if me == 0 else acc, 0, group).view(tensor.shape)


@api("ring_all_reduce")
def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Ring all-reduce (Patarasuk & Yuan 2009): ring reduce-scatter, then ring all-gather.

    Split into n chunks. Reduce-scatter: n-1 steps, each rank sends one chunk to its
    right neighbour and adds the chunk arriving from its left; afterwards rank r owns
    the full sum of chunk r. All-gather: n-1 more steps passing the finished chunks on.
    Each rank sends 2(n-1) chunks = 2(n-1)/n·S bytes, independent of n:
    T = 2(n-1)α + 2(n-1)/n·Sβ + (n-1)/n·Sγ.

    This is the readable version: each step sends, receives, waits, then adds, so
    the link idles during the add and the CPU idles during the transfer. See
    :func:`fast_ring_all_reduce` for the pipelined one.
    """
    me, n, acc = _prepare(tensor, group)
    ring_reduce_scatter_into(acc, me, n, group)
    ring_all_gather_into(acc, me, n, group)
    return acc.view(tensor.shape)


@api("recursive_halving_all_reduce")
def recursive_halving_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Rabenseifner's all-reduce (Thakur, Rabenseifner & Gropp 2005, §4.4).

    Reduce-scatter by recursive halving: in round k (k = 0..lg n-1) rank r swaps with
    r XOR 2^k, sends the half of its current range it gives up and adds the half it
    keeps, so after lg n rounds it owns one fully summed block of n. All-gather by
    recursive doubling: the same partners in reverse order (distances n/2, ..., 2, 1),
    each round swapping the ranges, which double. Bytes per rank 2(n-1)/n·S as for the
    ring, but 2 lg n messages instead of 2(n-1): T = 2 lg n·α + 2(n-1)/n·Sβ + (n-1)/n·Sγ.
    That is why it wins for small (latency-bound) messages.

    Non-power-of-two n (standard fold, Thakur et al. §4.4): with p = 2^⌊lg n⌋ and
    rem = n - p, ranks 0..2·rem-1 pair up; each even one sends its whole tensor to the
    odd one above it and sits out; the remaining p ranks run the algorithm; at the end
    the odd ones send the result back: + 2(α + Sβ) + Sγ.
    """
    me, n, acc = _prepare(tensor, group)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if me < 2 * rem and me % 2 == 0:           # folded out: contribute, then wait for the result
        wait_all([send_to(acc, me + 1, group)])
        wait_all([recv_from(acc, me + 1, group)])
        return acc.view(tensor.shape)
    if me < 2 * rem:                            # absorb the even partner's contribution
        buf = torch.empty_like(acc)
        wait_all([recv_from(buf, me - 1, group)])
        acc += buf
    v = me // 2 if me < 2 * rem else me - rem   # rank among the p active ones
    real = lambda u: 2 * u + 1 if u < rem else u + rem   # noqa: E731  (active rank -> group rank)

    bounds = [0]                                # element offsets of the p blocks
    for c in acc.tensor_split(p):
        bounds.append(bounds[-1] + c.numel())
    lo, hi, ranges, d = 0, p, [], 1
    buf = torch.empty_like(acc)
    while d < p:                                # reduce-scatter, distances 1, 2, 4, ...
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        k0, k1, g0, g1 = bounds[keep[0]], bounds[keep[1]], bounds[give[0]], bounds[give[1]]
        exchange(acc[g0:g1], real(v ^ d), buf[k0:k1], real(v ^ d), group)
        acc[k0:k1] += buf[k0:k1]
        ranges.append((lo, hi))
        lo, hi = keep
        d <<= 1
    while ranges:                               # all-gather, distances ..., 4, 2, 1
        d >>= 1
        plo, phi = ranges.pop()
        other = (plo, lo) if lo > plo else (hi, phi)
        exchange(acc[bounds[lo]:bounds[hi]], real(v ^ d),
                 acc[bounds[other[0]]:bounds[other[1]]], real(v ^ d), group)
        lo, hi = plo, phi
    if me < 2 * rem:                            # unfold: hand the result back
        wait_all([send_to(acc, me - 1, group)])
    return acc.view(tensor.shape)


@api("fast_ring_all_reduce")
def fast_ring_all_reduce(tensor: torch.Tensor, group=None, segment_bytes: int = 1 << 20,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The ring all-reduce, pipelined: the same messages' bytes and neighbours as
    :func:`ring_all_reduce`, arranged the way NCCL runs its ring.

    Why it is faster than the plain ring:

    1. **Chunks are cut into segments** of ``segment_bytes``, and each segment is
       forwarded as soon as it has been reduced: the add of segment j overlaps the
       transfer of segment j+1, and step t+1 starts while step t is still arriving.
       The ring becomes a pipeline, with no barrier between steps.
    2. **Receives are posted before the data is needed.** gloo (like NCCL, and MPI's
       rendezvous protocol for large messages) moves no bytes until the receiver has
       told the sender "my receive is posted" (gloo's NOTIFY_RECV_READY message). Each
       segment's receive is posted with the send of its slot, a whole ring step before
       it is waited for (on odd ranks even before the add that readies that send), so
       the handshake is mostly done when the data comes. The plain ring posts a receive
       only when it needs the data.
    3. **No extra memory or copies:** partial sums are formed in the output
       (``out[c] += x[c]``) and sent from there; the first step sends straight from the
       input. Fresh memory is expensive (every new page is a page fault), so ``out=``
       accepts a preallocated output, as nccl-tests' out-of-place mode uses.

    One loop serves both phases: at ring step t (0 ≤ t < 2(n-1); reduce-scatter, then
    all-gather) a rank sends chunk (me-t-1) to the right and receives chunk (me-t-2) from
    the left, so what it sends at step t is what arrived at step t-1 (plus its own part
    while reducing).

    Deadlock freedom, under NCCL too. NCCL's send blocks until the matching receive is
    posted, and ops between the same two ranks run in posting order. An earlier version
    posted every receive up front: at N = 2 the left and the right neighbour are the same
    rank, so both ranks' first ops were receives from each other and neither ever sent.
    Here slot (t, j), segment j of step t, is a send to the right and a receive from the
    left posted in :func:`~minidist.collectives.p2p.post_exchange`'s order (the lower rank
    of a pair sends first; in a ring of n > 2 even ranks send first), so it completes even
    when every op blocks until matched (tests/test_collectives.py runs it under
    :func:`minidist.runtime.strict_async.blocking_p2p`). The price on gloo, where receives
    up front were legal, is a handshake per slot on half the links: on 4 ranks (2 busy
    shared cores, three interleaved runs) 64 KiB took 1.1-2.8x as long as before, 1 MiB
    1.05-1.4x, 16 MiB 0.99-1.2x; still faster than the plain ring in every run.

    Why two receives may target the same output chunk (the reduce-scatter partial of
    chunk c, then the finished chunk c in the all-gather): transfers from the left
    neighbour match receives in posting order, and the finished chunk c can only come
    back round the ring after our partial of c has been forwarded and received, i.e.
    after our send from that memory is complete.
    """
    check_tensor(tensor)
    if not isinstance(segment_bytes, int) or segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != tensor.dtype
                            or out.device != tensor.device
                            or out.numel() != tensor.numel() or not out.is_contiguous()):
        raise ValueError("out must be a contiguous tensor with the input's dtype, device and number of elements")
    me, n = group_info(group)
    x = tensor.detach().reshape(-1).contiguous()
    res = torch.empty_like(x) if out is None else out.detach().view(-1)
    if x.numel() and res.data_ptr() < x.data_ptr() + x.nbytes and x.data_ptr() < res.data_ptr() + res.nbytes:
        raise ValueError("out must not overlap the input")
    if n == 1:
        return res.copy_(x).view(tensor.shape)
    xc, oc = x.tensor_split(n), res.tensor_split(n)
    seg = max(1, segment_bytes // x.element_size())
    right, left = (me + 1) % n, (me - 1) % n
    send_first = me < right if right == left else me % 2 == 0      # post_exchange's order

    def segments(t):
        return [t[i:i + seg] for i in range(0, t.numel(), seg)]

    sends, arrived = [], []          # arrived: [segment, its receive] of the previous step
    for t in range(2 * (n - 1)):
        c_out, c_in = (me - t - 1) % n, (me - t - 2) % n
        outgoing = segments(xc[c_out] if t == 0 else oc[c_out])
        own = segments(xc[c_out]) if 0 < t <= n - 1 else None     # reducing: my part of what I forward
        incoming = [[p, None] for p in segments(oc[c_in])]
        for j in range(max(len(outgoing), len(incoming))):
            for op in ("send", "recv") if send_first else ("recv", "send"):
                if op == "send" and j < len(outgoing):
                    if t > 0:        # what arrived in slot (t-1, j), plus my part while reducing
                        wait_all([arrived[j][1]])
                        if own is not None:
                            outgoing[j] += own[j]
                    sends.append(send_to(outgoing[j], right, group))
                elif op == "recv" and j < len(incoming):
                    incoming[j][1] = recv_from(incoming[j][0], left, group)
        arrived = incoming
    wait_all([w for _, w in arrived] + sends)
    return res.view(tensor.shape)


ALL_REDUCES = {
    "parameter_server": parameter_server_all_reduce,
    "naive": naive_all_reduce,
    "parallel": parallel_all_reduce,
    "tree": tree_all_reduce,
    "ring": ring_all_reduce,
    "recursive_halving": recursive_halving_all_reduce,
    "fast_ring": fast_ring_all_reduce,
}
