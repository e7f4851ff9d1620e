"""Per-rank memory of every ZeRO stage, measured, next to the formula and torch FSDP2.

For each stage (0 = bucketed DDP) and rank: bytes held by parameters, gradients and
Adam states after a step (live storages, ``minidist.memory``), the fp32 formula
(``minidist.cost``), and the peak during the step (profiler timeline on CPU). The last
rows are torch's FSDP2 (``fully_shard`` on every Linear and the root, CPU gloo) on the
same model, measured the same way from its DTensors' local shards. The rows feed
``minidist.plots.plot_zero_memory``.
"""
from __future__ import annotations

from minidist.cost import zero_memory_bytes_fp32      # the cost models import no torch: --help stays fast

LABEL = {"bucketed_ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def add_arguments(parser):
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-kb", type=int, default=128, help="ZeRO-1/2 and DDP bucket cap")
    parser.add_argument("--no-fsdp2", action="store_true", help="skip the torch FSDP2 comparison")


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t   # a DTensor's shard on this rank


def _fsdp2(model_kwargs, batch):
    """torch FSDP2 on the same model; returns (memory dict, peak) or raises if unsupported."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import minidist
    from minidist.memory import peak_bytes, storage_bytes
    from minidist.models import TinyMLP, mlp_batch
    mesh = init_device_mesh(minidist.device().type, (dist.get_world_size(),))
    model = TinyMLP(**model_kwargs)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank, n = dist.get_rank(), dist.get_world_size()

    def step(s):
        x, y = mlp_batch(s, batch, model.inp.in_features, model.out.out_features)
        k = batch // n
        F.mse_loss(model(x[rank * k:(rank + 1) * k]), y[rank * k:(rank + 1) * k]).backward()
        opt.step()

    step(0)
    opt.zero_grad()
    _, peak, kept = peak_bytes(step, 1)
    params = [_local(p) for p in model.parameters()]
    seen_grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    seen: set = set()            # FSDP2's gradient shards are views of one reduce-scatter output
    mem = {"params": storage_bytes(params, seen), "grads": storage_bytes(seen_grads, seen),
           "optimizer": storage_bytes(states, seen)}
    mem["total"] = sum(mem.values())
    return mem, mem["total"] - kept + peak


def _bench(model_kwargs, with_fsdp2, bucket_bytes):
    from minidist.harness.data_parallel import train_cases
    cases = [dict(variant=v, model_kwargs=model_kwargs, bucket_cap_bytes=bucket_bytes, steps=2, measure=True, peak=True, batch=48)
             for v in LABEL]
    out = {"ours": train_cases(cases)}
    if with_fsdp2:
        try:
            out["fsdp2"] = _fsdp2(model_kwargs, 48)
        except Exception as err:         # report, don't hide: the row says why
            out["fsdp2"] = f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"
    return out


def run(args) -> list[dict]:
    import minidist
    from minidist.harness.data_parallel import ZERO_STAGE
    n = args.world_size
    model_kwargs = dict(d_in=64, hidden=args.hidden, d_out=64, n_hidden=args.layers)
    out = minidist.launch(_bench, n, model_kwargs, not args.no_fsdp2, args.bucket_kb << 10, timeout=600)
    rows = []
    for i, variant in enumerate(LABEL):
        for rank in range(n):
            r = out[rank]["ours"][i]
            formula = zero_memory_bytes_fp32(ZERO_STAGE[variant], r["numel"], n)["total"]
            rows.append({"stage": LABEL[variant], "rank": rank, **{k: r["memory"][k] for k in
                         ("params", "grads", "optimizer", "total")}, "formula": formula,
                         "vs_formula": r["memory"]["total"] / formula, "peak_step": r["peak_step_bytes"]})
    if not args.no_fsdp2:
        numel = out[0]["ours"][0]["numel"]
        formula = zero_memory_bytes_fp32(3, numel, n)["total"]
        for rank in range(n):
            res = out[rank]["fsdp2"]
            if isinstance(res, str):
                rows.append({"stage": "torch FSDP2", "rank": rank, "note": f"does not run here: {res}"})
                continue
            mem, peak = res
            rows.append({"stage": "torch FSDP2", "rank": rank, **mem, "formula": formula,
                         "vs_formula": mem["total"] / formula, "peak_step": peak})
    return rows
