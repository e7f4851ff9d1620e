"""Bucketed DDP step time next to ``torch.nn.parallel.DistributedDataParallel``.

Same model, same data, same process group, same run: the two implementations take
alternate steps (after a barrier), so load from other processes hits both alike. The
step is forward + backward (with the overlapped bucket all-reduces) + Adam. Target:
minidist's bucketed DDP within 1.15× of torch's step time.
"""
from __future__ import annotations

import statistics


def add_arguments(parser):
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap for both (torch's default)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3)


def _bench(hidden, layers, batch, bucket_mb, steps, warmup):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import minidist
    from minidist.data_parallel import BucketedDDP, NaiveDDP
    from minidist.models import TinyMLP
    rank, n = dist.get_rank(), dist.get_world_size()
    shape = dict(d_in=256, hidden=hidden, d_out=256, n_hidden=layers)
    cap = int(bucket_mb * (1 << 20))
    impls = {
        "torch DDP": DistributedDataParallel(TinyMLP(**shape), bucket_cap_mb=bucket_mb),
        "minidist BucketedDDP": BucketedDDP(TinyMLP(**shape), bucket_cap_bytes=cap),
        "minidist NaiveDDP": NaiveDDP(TinyMLP(**shape)),
    }
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in impls.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(batch // n, 256, generator=g, device="cpu").to(minidist.device()) for _ in range(2))
    times = {k: [] for k in impls}
    for step in range(warmup + steps):
        for name, model in impls.items():
            dist.barrier()
            with minidist.timed() as t:
                F.mse_loss(model(x), y).backward()
                if isinstance(model, NaiveDDP):
                    model.sync_gradients()
                opts[name].step()
                opts[name].zero_grad()
            if step >= warmup:
                times[name].append(t.seconds)
    numel = sum(p.numel() for p in impls["torch DDP"].parameters())
    return {k: v for k, v in times.items()}, numel


def run(args) -> list[dict]:
    import minidist
    out = minidist.launch(_bench, args.world_size, args.hidden, args.layers, args.batch, args.bucket_mb,
                          args.steps, args.warmup, timeout=600)
    numel = out[0][1]
    # A step ends when the slowest rank ends: take the max over ranks, then the median over steps.
    med = {k: statistics.median(max(o[0][k][i] for o in out) for i in range(args.steps)) for k in out[0][0]}
    base = med["torch DDP"]
    return [{"implementation": k, "world_size": args.world_size, "params": numel,
             "bucket_mb": args.bucket_mb, "step_ms": 1e3 * v, "vs_torch": v / base,
             "target": "<= 1.15" if k == "minidist BucketedDDP" else ""} for k, v in med.items()]
