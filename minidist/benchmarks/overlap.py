"""Exposed communication of each overlap technique next to its plain version, measured from the trace.

One launch of ``--world-size`` ranks (default 4) times, step after step, each pair alternately
(after a barrier, so load from elsewhere hits both alike) with ``minidist.trace`` open:

* **all-gather + matmul**: sequence-parallel TP's column linear, forward and backward: plain
  (``tensor_parallel.sequence_parallel_linear``: gather, then matmul) against the ring
  (``overlap.all_gather_matmul``);
* **matmul + reduce-scatter**: the row linear, plain (``F.linear`` then
  ``reduce_scatter_along_dim``) against the ring (``overlap.matmul_reduce_scatter``);
* **DDP**: ``BucketedDDP`` with ``overlap=False`` (every bucket after backward) against buckets
  launched during backward;
* **FSDP**: ``FullyShardedDataParallel`` without and with ``prefetch``, and the forward's peak
  memory of each (``minidist.memory.peak_bytes``) next to ``cost.overlap.prefetch_extra_bytes``.

A step's exposed time is the mean over ranks of the time each waited on communication inside
the step (``minidist.trace.timeline``); a row gives the median over steps, and ``exposed_ratio``
is the overlapped version's over the plain one's. The collective matmul rows also give the model:
α and β fitted from point-to-point ping-pongs and the ranks' matmul FLOP rate, fed to
``cost.overlap.collective_matmul``. On CPU ranks the same cores compute and move the bytes
(gloo's threads), so hiding communication shortens a step little or not at all: the exposed time
falls, the step time need not. On CUDA ranks the host's view is what is measured (a compute
span is the time to queue kernels): there step times, not exposed times, are the numbers to read.
"""
from __future__ import annotations

import statistics
import sys

from minidist import cost             # the cost models import no torch: --help stays fast


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (collective matmuls)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence, split over the ranks")
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--d-out", type=int, default=512, help="this rank's output features")
    parser.add_argument("--hidden", type=int, default=512, help="width of the DDP and FSDP models")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per version")
    parser.add_argument("--warmup", type=int, default=1)


# ---------------------------------------------------------------------------------- on the ranks
def _versions(a):
    """(name -> (plain step, overlapped step), the two FSDP wrappers by prefetch, a batch for them)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    from minidist.data_parallel import BucketedDDP, FullyShardedDataParallel
    from minidist.overlap import all_gather_matmul, matmul_reduce_scatter
    from minidist.runtime import device
    from minidist.tensor_parallel import reduce_scatter_along_dim, sequence_parallel_linear
    rank, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    rand = lambda *s: torch.randn(*s, generator=g).to(device())     # noqa: E731
    shard, w = rand(a.batch, a.seq // t, a.d_in).requires_grad_(), rand(a.d_out, a.d_in).requires_grad_()
    full, w_row = rand(a.batch, a.seq, a.d_in).requires_grad_(), rand(a.d_out, a.d_in).requires_grad_()
    x, y = rand(16, a.hidden), rand(16, a.hidden)

    def mlp():
        return nn.Sequential(*[nn.Linear(a.hidden, a.hidden, device=device()) for _ in range(4)])

    def linear_step(fn, *inputs):
        return lambda: fn(*inputs).square().mean().backward()

    def ddp_step(overlap):
        model = BucketedDDP(mlp(), bucket_cap_bytes=(a.hidden + 1) * a.hidden * 4, overlap=overlap)
        return lambda: F.mse_loss(model(x), y).backward()

    fsdp = {p: FullyShardedDataParallel(mlp(), optimizer_cls=torch.optim.SGD, prefetch=p, lr=1e-3)
            for p in (False, True)}

    def fsdp_step(f):
        def step():
            F.mse_loss(f(x), y).backward()
            f.step()
            f.zero_grad()
        return step

    rs = lambda x, w: reduce_scatter_along_dim(F.linear(x, w), 1)      # noqa: E731
    return ({"all-gather + matmul": (linear_step(sequence_parallel_linear, shard, w),
                                     linear_step(all_gather_matmul, shard, w)),
             "matmul + reduce-scatter": (linear_step(rs, full, w_row), linear_step(matmul_reduce_scatter, full, w_row)),
             "DDP buckets": (ddp_step(False), ddp_step(True)),
             "FSDP prefetch": (fsdp_step(fsdp[False]), fsdp_step(fsdp[True]))}, fsdp, (x, y))


def _measure(a):
    import torch.distributed as dist
    import torch.nn.functional as F

    from minidist.benchmarks.plan import _matmul_flops, _p2p
    from minidist.memory import peak_bytes
    from minidist.trace import span, trace
    versions, fsdp, (x, y) = _versions(a)
    out = {"p2p": _p2p((8, 64 << 10, 1 << 20), 5), "flops": _matmul_flops(a.batch * a.seq // 4, a.d_in, a.d_out)}
    with trace() as t:
        for step in range(a.warmup + a.steps):
            for name, pair in versions.items():
                for kind, fn in zip(("plain", "overlapped"), pair):
                    dist.barrier()
                    with span("step", technique=name, version=kind, timed=step >= a.warmup):
                        fn()
    out["fsdp_peak"] = {p: peak_bytes(lambda f=f: F.mse_loss(f(x), y))[1] for p, f in fsdp.items()}
    out["units"] = [u._bytes for u in fsdp[True].units]
    out["trace"] = t
    return out


# ---------------------------------------------------------------------------------- in the parent
def _rows(out, a) -> list[dict]:
    from minidist.trace import merge
    from minidist.trace.timeline import exposed, in_flight
    t = merge(o["trace"] for o in out)
    n = len(out)
    sizes = sorted(out[0]["p2p"])
    fit = cost.fit_alpha_beta(sizes, [statistics.median(max(o["p2p"][s][i] for o in out)
                                                        for i in range(len(out[0]["p2p"][s]))) for s in sizes])
    flops = statistics.median(o["flops"] for o in out)
    model = {"all-gather + matmul": cost.collective_matmul(a.batch * a.seq, a.d_in, a.d_out, n, fit.alpha, fit.beta,
                                                           flops, gathered="input"),
             "matmul + reduce-scatter": cost.collective_matmul(a.batch * a.seq, a.d_in, a.d_out, n, fit.alpha,
                                                               fit.beta, flops, gathered="output")}
    rows = []
    for name in dict.fromkeys(e.meta["technique"] for e in t.events if e.op == "span:step"):
        base = None
        for kind in ("plain", "overlapped"):
            steps = [[e for e in t.events if e.op == "span:step" and e.rank == r and e.meta["technique"] == name
                      and e.meta["version"] == kind and e.meta["timed"]] for r in range(n)]
            per_step = list(zip(*steps))
            waited = statistics.median(statistics.fmean(exposed(t, e.rank, (e.start, e.end)) for e in s)
                                       for s in per_step)
            flight = statistics.median(statistics.fmean(in_flight(t, e.rank, (e.start, e.end)) for e in s)
                                       for s in per_step)
            step = statistics.median(max(e.end - e.start for e in s) for s in per_step)
            row = {"technique": name, "version": kind, "world_size": n, "step_ms": 1e3 * step,
                   "exposed_ms": 1e3 * waited, "in_flight_ms": 1e3 * flight}
            base = row if kind == "plain" else base
            if kind == "overlapped":
                row["exposed_ratio"] = waited / (base["exposed_ms"] / 1e3) if base["exposed_ms"] else float("nan")
                row["step_ratio"] = step / (base["step_ms"] / 1e3)
            if name in model:
                row["model_exposed_ms"] = 1e3 * model[name]["exposed_plain_s" if kind == "plain" else "exposed_ring_s"]
            if name == "FSDP prefetch":
                row["forward_peak_bytes"] = out[0]["fsdp_peak"][kind == "overlapped"]
                if kind == "overlapped":
                    row["prefetch_extra_bytes"] = row["forward_peak_bytes"] - base["forward_peak_bytes"]
                    row["prefetch_extra_formula"] = cost.prefetch_extra_bytes(out[0]["units"])
            rows.append(row)
    for row in rows:
        row.update({"alpha_us": fit.alpha * 1e6, "gflops_per_rank": flops / 1e9})
    return rows


def run(args) -> list[dict]:
    from minidist.runtime import launch
    if args.seq % args.world_size:
        raise ValueError(f"--seq {args.seq} must divide over --world-size {args.world_size} ranks")
    out = launch(_measure, args.world_size, args, timeout=600)
    rows = _rows(out, args)
    ag = next(r for r in rows if r["technique"] == "all-gather + matmul" and r["version"] == "overlapped")
    print(f"all-gather + matmul on {args.world_size} ranks: exposed {ag['exposed_ms']:.2f} ms decomposed vs "
          f"{ag['exposed_ms'] / ag['exposed_ratio']:.2f} ms plain (ratio {ag['exposed_ratio']:.2f}); "
          f"step {ag['step_ratio']:.2f}x the plain one's", file=sys.stderr)
    return rows
