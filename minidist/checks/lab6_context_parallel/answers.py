"""Lab 6's answers: what the student's function did, as plain data (its results, digests of the
caller's tensors after the call, the traffic it traced, the ring's timings). The only file of lab
6's checks that calls student code.

The distributed functions run on this rank (rank ``on.r`` of a group of ``on.t``) on inputs built on
the CPU and copied to ``minidist.device()``; the merge runs in the calling process.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from minidist.checks.kit.compare import digest, on_rank, traffic
from minidist.checks.kit.raises import attempt
from minidist.checks.lab6_context_parallel.cases import (F64, LATE_S, SEQ, a2a_inputs, merge_inputs, part, qkv,
                                                         zigzag_input)
from minidist.runtime.device import device as rank_device
from minidist.runtime.strict_async import blocking_p2p
from minidist.trace import P2P_RECV, P2P_SEND, trace


class FirstCompute(TorchFunctionMode):
    """When this rank first multiplied matrices (``@``, ``matmul``, ``einsum``, SDPA, ...): the start
    of a block's attention, however it is written."""
    OPS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "baddbmm", "einsum", "tensordot",
           "scaled_dot_product_attention"}

    def __init__(self):
        super().__init__()
        self.first = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.first is None and getattr(func, "__name__", "") in self.OPS:
            self.first = time.time()
        return func(*args, **(kwargs or {}))


def exchange(fn, case, on) -> dict:
    """This rank's chunk along the gather dim (a non-leaf) through the all-to-all, forward and backward."""
    sd, gd, r, t = case["scatter"], case["gather"], on.r, on.t
    _, full, up = a2a_inputs(case, t)
    if case.get("raises"):
        return attempt(fn, (on_rank(part(full, gd, r, t)), sd, gd, on.group))
    x = on_rank(part(full, gd, r, t), grad=True)
    given = x * 1
    with trace() as tf:
        out = fn(given, sd, gd, on.group)
    answer = {"given": digest(given), "out": out, "forward": traffic(tf)}
    with trace() as tb:
        (out * on_rank(part(up, sd, r, t))).sum().backward()
    return {**answer, "grad": x.grad, "backward": traffic(tb)}


def ulysses(fn, case, on) -> dict:
    """Ulysses on this rank's sequence shards of q, k, v, forward and backward; where the heads do not
    split, the call that must raise ValueError before any message."""
    (q, k, v, w), h, h_kv, dtype = qkv(case)
    cut = lambda x: part(x, SEQ, on.r, on.t).to(dtype)          # noqa: E731
    if case.get("raises") and not (h % on.t or h_kv % on.t):
        return {"alone": True}                  # the rank left alone by t = 3: its group of one splits anything
    if case.get("raises"):
        return attempt(fn, tuple(on_rank(cut(x)) for x in (q, k, v)) + (case["causal"], on.group))
    mine = [on_rank(cut(x), grad=True) for x in (q, k, v)]
    with trace() as tf:
        out = fn(*mine, case["causal"], on.group)
    answer = {"given": [digest(x) for x in mine], "out": out, "forward": traffic(tf)}
    with trace() as tb:
        (out * on_rank(cut(w))).sum().backward()
    return {**answer, "grads": [x.grad for x in mine], "backward": traffic(tb)}


def _overlap_times(r, group, start, first) -> list:
    """The overlap case: group rank 0 started ``LATE_S`` late; [rank 0's start, rank 1's first
    compute], exchanged outside the trace (rank 1 judges them)."""
    times = torch.tensor([start if r == 0 else 0.0, (first or 0.0) if r == 1 else 0.0], dtype=F64,
                         device=rank_device())
    dist.all_reduce(times, group=group)
    return times.tolist()


def _ring_events(tr, group) -> list:
    """[send/recv (or the operation), bytes, the peer's rank in the group (None outside it)] per operation."""
    def in_group(peer):
        if group is None or peer is None:
            return peer
        try:
            return dist.get_group_rank(group, peer)
        except (ValueError, RuntimeError):
            return None
    return [["send" if e.op in P2P_SEND else "recv" if e.op in P2P_RECV else e.op, e.nbytes, in_group(e.peer)]
            for e in tr.comm()]


def ring(fn, case, on) -> dict:
    """The ring's forward on this rank's sequence shards: (out, lse), the messages it traced, and for
    the late case, when rank 0 started and rank 1 first computed. ``blocking``: every isend/irecv
    blocks until matched (NCCL's worst case)."""
    (q, k, v, _), _, _, dtype = qkv(case)
    r, group = on.r, on.group
    mine = [on_rank(part(x, SEQ, r, on.t).to(dtype)) for x in (q, k, v)]
    blocking = blocking_p2p() if case.get("blocking") else contextlib.nullcontext()
    seen = FirstCompute() if case.get("late") else contextlib.nullcontext()
    if case.get("late"):
        dist.barrier(group=group)               # a common start (outside the trace), then rank 0 is late
        if r == 0:
            time.sleep(LATE_S)
    start = time.time()
    with blocking, trace() as tf, seen:
        result = fn(*mine, case["causal"], group)
    late = _overlap_times(r, group, start, seen.first) if case.get("late") else None
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    return {"shape": ok, "out": result[0] if ok else None, "lse": result[1] if ok else None,
            "given": [digest(x) for x in mine], "events": _ring_events(tf, group), "late": late}


def zigzag(fn, case, on) -> dict:
    """This rank's zigzag chunks of the whole tensor (which every rank holds); where the sequence does
    not cut into 2P chunks, the call that must raise ValueError before any message."""
    x = zigzag_input(case)
    if case["shape"][SEQ] % (2 * on.t):
        return attempt(fn, (on_rank(x), on.group))
    given = on_rank(x)
    with trace() as tr:
        out = fn(given, on.group)
    return {"out": out, "given": digest(given), "traffic": traffic(tr)}


def merge(fn, case) -> dict:
    """In the calling process: the merge of two partial attentions, and digests of the inputs after it."""
    given = [x.clone() for x in merge_inputs(case)]
    result = fn(*given)
    return {"result": result, "given": [digest(g) for g in given]}


#: per distributed graded function: answer(fn, case, on)
ANSWER = {"all_to_all": exchange, "ulysses_attention": ulysses, "ring_attention_forward": ring,
          "zigzag_shard": zigzag}
