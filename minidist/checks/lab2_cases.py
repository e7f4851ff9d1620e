"""Lab 2's rank-dependent cases: gradients that differ in *shape of the work* between ranks.

The training checks (:mod:`minidist.checks.kit.training`) use models that behave the same on
every rank. Real data-parallel models do not always: a branch may run on some ranks only
(a data-dependent path), and two branches may be computed in another order, so that
autograd fires the gradient hooks in another order (Li et al. 2020, *PyTorch Distributed*,
§3.2.3: buckets must be all-reduced in the same order on every rank, whatever order they
fill in). :class:`RankDependentNet` has both, and :func:`rank_dependent_grads` runs one of
the lab's gradient syncs on it inside a check's launch, next to the training cases (one
launch per world size). What must come out, on every rank and every step, is the mean
over ranks of the local gradients, ``(1/N) Σ_r g_r`` with a branch a rank did not run
counting as zeros, bit-identical on every rank (replicas that differ drift apart).

:func:`overlap_probe` makes the overlap check deterministic: rank 1 starts its step only
once rank 0's backward has produced its last gradient (or after ``hold`` seconds). An
all-reduce that backward waits for (no ``async_op``, or ``wait()`` in the hook) cannot
complete without rank 1, so rank 0's backward cannot get that far first: caught on every
run, not when a race happens to show. (Waiting at the very end of backward, as torch's DDP
does from an autograd callback, is fine: every gradient has been produced by then.)
:func:`overlapped` compares both ranks' probes (in the check and in the grader's judge).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

from minidist.checks.kit.launch import mark_case
from minidist.models import TinyMLP, mlp_batch
from minidist.runtime import device

#: bytes of ``out``: with this cap every parameter of the hidden layers gets a bucket of its own
#: (8·8·4 = 256 and 8·4 = 32 bytes), so a bucket launched out of order is one of its own size.
PROBE_CAP = 180
PROBE_STEPS = 2


class RankDependentNet(nn.Module):
    """``inp -> a, b (summed) -> mid (even ranks only) -> out``, in that parameter order.

    Even ranks compute branch ``a`` before ``b``, odd ranks ``b`` before ``a``: autograd runs
    the later branch's backward first, so the gradient hooks of ``a`` and ``b`` fire in
    opposite orders on neighbouring ranks. ``mid`` (in the middle of the parameter list) is
    used on even ranks only: on odd ranks its gradient is missing.
    """

    def __init__(self, d_in: int = 6, width: int = 8, d_out: int = 5, device=None):
        super().__init__()
        g = torch.random.get_rng_state()
        torch.manual_seed(7)
        with torch.device("cpu"):           # the CPU generator draws the weights, then they move to the rank's device
            self.inp, self.a = nn.Linear(d_in, width), nn.Linear(width, width)
            self.mid, self.b = nn.Linear(width, width), nn.Linear(width, width)
            self.out = nn.Linear(width, d_out)
        torch.random.set_rng_state(g)
        self.to(device if device is not None else "cpu")

    def forward(self, x):
        rank = dist.get_rank()
        h = torch.tanh(self.inp(x))
        first, second = (self.a, self.b) if rank % 2 == 0 else (self.b, self.a)
        u = torch.tanh(first(h))
        h = u + torch.tanh(second(h))
        if rank % 2 == 0:
            h = h + torch.tanh(self.mid(h))
        return self.out(h)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def rank_dependent_grads(progress, kind: str, impl, cap: int = PROBE_CAP) -> list[dict]:
    """Inside a rank: per step, this rank's local gradients (computed on a copy of the model
    that nobody syncs) and the gradients after the student's sync, on :class:`RankDependentNet`."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mark_case(progress, "RankDependentNet (a layer used on even ranks only, branch order by rank)"
                        + (f", bucket_cap_bytes={cap}" if kind == "bucketed_ddp" else ""))
    model = RankDependentNet(device=device())
    local = copy.deepcopy(model)
    ddp = impl(model, bucket_cap_bytes=cap) if kind == "bucketed_ddp" else None
    out = []
    for step in range(PROBE_STEPS):
        x, y = mlp_batch(100 + step, 4 * n, device=device())
        x, y = x[4 * rank:4 * (rank + 1)], y[4 * rank:4 * (rank + 1)]
        F.mse_loss(local(x), y).backward()
        F.mse_loss((ddp or model)(x), y).backward()
        if ddp is None:
            impl(model)
        else:
            ddp.finish_gradient_sync()
        out.append({"local": _grads(local), "synced": _grads(model)})
        local.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return out


def check_rank_dependent(name: str, world_size: int, per_rank: list[list[dict]], tol: float = 1e-5) -> None:
    """Every rank's synced gradients equal the mean of the ranks' local ones (a missing one
    counts as zeros) and are identical on every rank."""
    names = [k for k, _ in RankDependentNet().named_parameters()]
    what = (f"{name} (world_size={world_size}, RankDependentNet: layer 'mid' used on even ranks only, "
            f"branches 'a' and 'b' computed in another order on odd ranks, so their hooks fire in another order)")
    for step in range(PROBE_STEPS):
        for k, pname in enumerate(names):
            locs = [per_rank[r][step]["local"][k] for r in range(world_size)]
            used = [g for g in locs if g is not None]     # RankDependentNet: every parameter on some rank
            want = torch.stack(used).sum(0) / world_size
            for r in range(world_size):
                got = per_rank[r][step]["synced"][k]
                if got is None:
                    raise AssertionError(f"{what}, step {step}: rank {r} has no gradient for '{pname}' after the "
                                         f"sync, but other ranks used it; every rank needs the average (a rank that "
                                         f"did not use a parameter contributes zeros and still receives the mean)")
                if got.shape != want.shape or (got - want).abs().max().item() > tol:
                    raise AssertionError(f"{what}, step {step}: rank {r}'s gradient of '{pname}' is not the mean over "
                                         f"ranks of the local gradients (max |error| "
                                         f"{(got - want).abs().max().item() if got.shape == want.shape else 'shape'}). "
                                         f"Every rank must make the same collective calls, in the same order, on "
                                         f"the same tensors, whichever layers it used and whatever order its "
                                         f"hooks fired in.")
            if any(not torch.equal(per_rank[r][step]["synced"][k], per_rank[0][step]["synced"][k])
                   for r in range(world_size)):
                raise AssertionError(f"{what}, step {step}: the ranks hold different gradients for '{pname}' "
                                     f"after the sync: the replicas will drift apart")


# ----------------------------------------------------------------------------- overlap
def overlap_probe(progress, BucketedDDP, cap: int, hold: float = 4.0) -> dict:
    """Inside a rank: one traced step of ``BucketedDDP`` on a 4-layer MLP; rank 1 starts only
    once rank 0's backward has produced its last gradient (at most ``hold`` s later)."""
    from minidist.trace import trace
    rank = dist.get_rank()
    mark_case(progress, f"overlap, bucket_cap_bytes={cap}")
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


def overlapped(cap, out) -> None:
    """The overlap check's comparison of both ranks' :func:`overlap_probe` results (``cap``: its bucket size)."""
    if out[1]["waited_out"]:
        raise AssertionError(
            f"BucketedDDP overlap (world_size=2, bucket_cap_bytes={cap}): rank 0's backward could not produce its "
            "last gradient while rank 1 had not started yet: backward waited for an all-reduce to complete (a blocking all_reduce, "
            "or wait() inside the hook). Launch with async_op=True and wait only in finish_gradient_sync, so "
            "that communication runs while backward keeps computing.")
    for r, res in enumerate(out):
        if len(res["starts"]) < 2:
            raise AssertionError(f"BucketedDDP overlap (world_size=2, bucket_cap_bytes={cap}), rank {r}: "
                                 f"{len(res['starts'])} all-reduce(s) for {res['buckets']} buckets")
        if res["last"] is None or not res["starts"][0] < res["last"]:
            raise AssertionError(
                f"BucketedDDP overlap (world_size=2, bucket_cap_bytes={cap}), rank {r}: no all-reduce started "
                f"before backward produced its last gradient. Launch a bucket's all-reduce with async_op=True "
                f"from the gradient hook as soon as the bucket is full, not after backward.")
