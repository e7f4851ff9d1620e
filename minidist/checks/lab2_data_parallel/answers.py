"""Lab 2's answers: what the student's code did, as plain data (the only code of this lab's checks
that calls student code). ``split_batch`` and ``make_buckets`` run in this process; the training,
the rank-dependent model and the overlap probe on every rank of a launch."""
from __future__ import annotations

import time

import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

from minidist.checks.kit.compare import digest
from minidist.checks.kit.raises import outcome
from minidist.checks.kit.returned import returned
from minidist.checks.kit.run import mark
from minidist.checks.kit.training import trained
from minidist.checks.lab2_data_parallel.cases import (PROBE_CAP, PROBE_STEPS, RankDependentNet, bucket_params,
                                                      probe_batch, split_inputs)
from minidist.models import TinyMLP, mlp_batch
from minidist.runtime import device
from minidist.trace import trace


def split(split_batch, case):
    """A batch that must not split: what the call did. Otherwise, per rank: the block it got, and
    the digests of the caller's x and y after the call (they must come back unchanged)."""
    x, y = split_inputs(case)
    if case[0] == "bad":
        return outcome(lambda: split_batch(x, y, 0, case[2]))
    out = []
    for r in range(case[2]):
        got = returned(split_batch(x, y, r, case[2]), f"split_batch(batch={case[1]}, rank={r}, world_size={case[2]})")
        out.append({**got, "x": digest(x), "y": digest(y)})
    return out


def buckets(make_buckets, case) -> dict:
    """The buckets as indices of the parameters given (what was returned, if it is not that), and
    the digests of the parameters' values after the call."""
    params = bucket_params(case)
    idx = {id(p): i for i, p in enumerate(params)}      # before the call: it may reorder its argument
    record = returned(make_buckets(params, case[2]), f"make_buckets(cap_bytes={case[2]})")
    if "foreign" in record:
        return record
    got = record["returned"]
    try:
        indices = [[idx[id(p)] for p in b] for b in got]
    except (KeyError, TypeError):
        indices = f"{got!r:.200}"
    return {"buckets": indices, "after": [digest(p) for p in sorted(params, key=lambda p: idx[id(p)])]}


def trained_and_probed(fn, case, *, kind: str) -> dict:
    """Inside a rank: the training cases, then the rank-dependent model, in the same launch."""
    return {"trained": trained(kind, fn, case[1]), "probe": rank_dependent(kind, fn)}


def trained_only(fn, case, *, kind: str) -> list:
    """Inside a rank: the training cases (their traced traffic, for the traffic checks)."""
    return trained(kind, fn, case[1])


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def rank_dependent(kind: str, impl, cap: int = PROBE_CAP) -> list:
    """Inside a rank: per step, the gradients after the student's sync on
    :class:`~minidist.checks.lab2_data_parallel.cases.RankDependentNet` (the verdict computes
    every rank's local ones itself)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mark("RankDependentNet (a layer used on even ranks only, branch order by rank)"
         + (f", bucket_cap_bytes={cap}" if kind == "bucketed_ddp" else ""))
    model = RankDependentNet(rank, device=device())
    ddp = impl(model, bucket_cap_bytes=cap) if kind == "bucketed_ddp" else None
    out = []
    for step in range(PROBE_STEPS):
        x, y = probe_batch(step, rank, n, device=device())
        F.mse_loss((ddp or model)(x), y).backward()
        if ddp is None:
            impl(model)
        else:
            ddp.finish_gradient_sync()
        out.append(_grads(model))
        model.zero_grad(set_to_none=True)
    return out


def overlap(BucketedDDP, cap: int, hold: float = 4.0) -> dict:
    """Inside a rank: one traced step of ``BucketedDDP`` on a 4-layer MLP; rank 1 starts only once
    rank 0's backward has produced its last gradient (at most ``hold`` s later).

    An all-reduce that backward waits for (no ``async_op``, or ``wait()`` in the hook) cannot
    complete without rank 1, so rank 0's backward cannot get that far first: caught on every run,
    not when a race happens to show. (Waiting at the very end of backward, as torch's DDP does from
    an autograd callback, is fine: every gradient has been produced by then.)"""
    rank = dist.get_rank()
    mark(f"overlap, bucket_cap_bytes={cap}")
    store = c10d._get_default_store()
    model = TinyMLP(hidden=48, n_hidden=4, device=device())
    ddp = BucketedDDP(model, bucket_cap_bytes=cap)
    marks = {}

    def last_gradient(p):      # the input layer's weight is the last gradient backward produces
        marks.setdefault("last", time.perf_counter())
        if rank == 0:
            store.set("minidist-overlap-last-gradient", "1")

    model.inp.weight.register_post_accumulate_grad_hook(last_gradient)
    x, y = mlp_batch(0, 16, 6, 5, device=device())
    waited_out = False
    if rank == 1:
        deadline = time.monotonic() + hold
        while not store.check(["minidist-overlap-last-gradient"]):
            if time.monotonic() > deadline:
                waited_out = True
                break
            time.sleep(0.005)
    with trace() as t:
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_sync()
    starts = sorted(e.start for e in t.comm() if e.op == "all_reduce")
    return {"starts": starts, "last": marks.get("last"), "buckets": len(ddp.buckets), "waited_out": waited_out}

