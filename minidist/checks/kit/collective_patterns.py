"""The communication pattern of a collective, read from its trace: who talks to whom, how many
messages, how many bytes, against the algorithm's formula (S: one rank's tensor in bytes, N ranks).

* ring all-reduce (Patarasuk & Yuan 2009): messages only to the ring's neighbours, 2(N-1)/N·S bytes
  sent and received per rank (reduce-scatter and all-gather: (N-1)/N·S each);
* recursive halving/doubling (Rabenseifner 2004; Thakur et al. 2005): lg N rounds with partners
  rank XOR 1, 2, 4, ... and messages S/2, S/4, ..., then the same back, 2(N-1)/N·S in all;
* naive all-reduce: a reduce through the root ((N-1)·S received there) and a broadcast of the sum
  (each other rank receives S once), 2(N-1)·S over all ranks.

``PATTERNS[name](function name, case, merged trace)`` raises ``AssertionError`` naming the rank,
what was expected and what was seen; :mod:`minidist.checks.kit.collectives` calls it after the
values matched torch's.
"""
from __future__ import annotations

import torch

from minidist.trace import Trace


def _fail(name, case, rank, expected, seen, hint=""):
    raise AssertionError(f"{name} ({case}), communication pattern, rank {rank}: expected {expected}; "
                         f"seen {seen}.{' ' + hint if hint else ''}")


def _messages(t: Trace, rank: int):
    return [e for e in t.select(rank).events if e.is_send or e.is_recv]


def _check_bytes(name, case, t, rank, nominal, what, slack_elems=2):
    item = torch.empty((), dtype=case.dtype).element_size()
    slack = slack_elems * item
    for direction, seen in (("sent", t.bytes_sent(rank)), ("received", t.bytes_received(rank))):
        if abs(seen - nominal) > slack:
            hint = ("That is about the whole tensor at every step: send one chunk per step."
                    if seen > 1.5 * nominal else "Too little: is a phase missing?")
            _fail(name, case, rank, f"{direction} bytes = {what} = {nominal:.0f} (±{slack} for chunk rounding)",
                  f"{seen} bytes {direction}", hint)


def ring_pattern(name, case, t, factor=2):
    """Only ring neighbours, and factor·(N-1)/N·S bytes each way per rank (2 for all-reduce,
    1 for reduce-scatter / all-gather)."""
    n, S = case.world_size, case.length * torch.empty((), dtype=case.dtype).element_size()
    for r in range(n):
        peers = {e.peer for e in _messages(t, r)}
        far = peers - {(r - 1) % n, (r + 1) % n}
        if far:
            _fail(name, case, r, f"messages only to/from ring neighbours {sorted({(r - 1) % n, (r + 1) % n})}",
                  f"messages with rank(s) {sorted(far)}")
        _check_bytes(name, case, t, r, factor * (n - 1) / n * S, f"{factor}(N-1)/N·S")


def halving_pattern(name, case, t):
    """Rabenseifner: lg N halving rounds then lg N doubling rounds, partner r XOR d for
    d = 1, 2, 4, ... (either order), message sizes halving then doubling, 2(N-1)/N·S bytes."""
    n, item = case.world_size, torch.empty((), dtype=case.dtype).element_size()
    S, lg = case.length * item, n.bit_length() - 1
    if n & (n - 1):
        raise ValueError("halving_pattern needs a power-of-two world size")
    for r in range(n):
        sends = [e for e in _messages(t, r) if e.is_send]
        if len(sends) != 2 * lg:
            _fail(name, case, r, f"2·lg N = {2 * lg} messages sent (lg N halving + lg N doubling rounds)",
                  f"{len(sends)} messages sent")
        dist_seen = [e.peer ^ r for e in sends]
        if sorted(dist_seen[:lg]) != [1 << k for k in range(lg)] or dist_seen[lg:] != dist_seen[:lg][::-1]:
            _fail(name, case, r, f"partners rank XOR 1, 2, 4, ... (XOR-distances {[1 << k for k in range(lg)]}), "
                  f"then the same partners in reverse order", f"XOR-distances {dist_seen}")
        sizes = [e.nbytes for e in sends]
        for k in range(lg):
            for got, want in ((sizes[k], S / 2 ** (k + 1)), (sizes[2 * lg - 1 - k], S / 2 ** (k + 1))):
                if abs(got - want) > n * item:
                    _fail(name, case, r, f"message sizes S/2, S/4, ... then back up: {[S / 2 ** (j + 1) for j in range(lg)]}",
                          f"sizes {sizes}", "Each round should send only the half you give up.")
        _check_bytes(name, case, t, r, 2 * (n - 1) / n * S, "2(N-1)/N·S", slack_elems=n)


def through_root_pattern(name, case, t, root=0):
    """Naive all-reduce: a reduce through rank 0, then a broadcast of the sum from it.

    The reduce: every other rank sends its tensor (S bytes) to rank 0, which receives
    (N-1)·S. The broadcast may be any broadcast (the root sending to everyone, or a binomial
    tree): every rank other than the root receives the sum exactly once (S bytes), so all
    ranks together send 2(N-1)·S bytes."""
    n, S = case.world_size, case.length * torch.empty((), dtype=case.dtype).element_size()
    for r in range(n):
        if r == root:
            continue
        to_root = sum(e.nbytes for e in _messages(t, r) if e.is_send and e.peer == root)
        if to_root != S:
            _fail(name, case, r, f"{S} bytes sent to rank {root} (its whole tensor, once: the reduce goes "
                                 f"through rank {root})", f"{to_root} bytes sent to rank {root}")
        if t.bytes_received(r) != S:
            _fail(name, case, r, f"{S} bytes received (the sum, once, from the broadcast)",
                  f"{t.bytes_received(r)} bytes received")
    from_peers = {r: sum(e.nbytes for e in _messages(t, root) if e.is_recv and e.peer == r)
                  for r in range(n) if r != root}
    if any(v != S for v in from_peers.values()) or t.bytes_received(root) != (n - 1) * S:
        _fail(name, case, root, f"(N-1)·S = {(n - 1) * S} bytes received, S = {S} from every other rank",
              f"{t.bytes_received(root)} bytes received ({from_peers})")
    total = sum(t.bytes_sent(r) for r in range(n))
    if total != 2 * (n - 1) * S:
        _fail(name, case, root, f"2(N-1)·S = {2 * (n - 1) * S} bytes sent by all ranks together "
                                f"((N-1)·S for the reduce, (N-1)·S for the broadcast)", f"{total}")


PATTERNS = {
    "ring": ring_pattern,
    "ring_reduce_scatter": lambda name, case, t: ring_pattern(name, case, t, factor=1),
    # all-gather of S bytes per rank: (N-1) pieces of S each way, i.e. N·(N-1)/N·S
    "ring_all_gather": lambda name, case, t: ring_pattern(name, case, t, factor=case.world_size),
    "halving": halving_pattern,
    "naive": through_root_pattern,
}
