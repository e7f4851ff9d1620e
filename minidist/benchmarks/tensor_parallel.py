"""Tensor-parallel TinyGPT training step next to torch's own tensor parallelism.

Same TinyGPT weights, same batch, same process group: minidist's ``tensor_parallel_gpt``
(autograd Functions around plain ``torch.distributed`` collectives) against
``torch.distributed.tensor.parallel.parallelize_module`` (DTensor: ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, vocab-parallel embedding, ``loss_parallel``),
with and without sequence parallelism, on CPU gloo. The implementations take alternate
steps (after a barrier) so load from other processes hits both alike; a step is forward,
vocab-parallel loss, backward, (SP) LayerNorm-gradient sync, and Adam. A step ends when
the slowest rank ends: max over ranks, then median over steps. Target: minidist ≤ 1.1×
torch's step time. Models, batch and mesh are on the rank's device (``minidist.device()``),
and times go through ``minidist.timed`` (on a GPU it waits for the queued kernels).
"""
from __future__ import annotations

import copy
import statistics


def add_arguments(parser):
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2)


def _step(model, opt, ids, targets, ours: bool):
    """One training step; returns (seconds for forward+backward, seconds in all)."""
    from torch.distributed.tensor.parallel import loss_parallel

    from minidist.models import gpt_loss
    from minidist.runtime import timed
    with timed() as step:
        with timed() as fwd_bwd:
            logits = model(ids)
            if ours:
                model.loss(logits, targets).backward()
                model.sync_grads()
            else:
                with loss_parallel():
                    gpt_loss(logits, targets).backward()
        opt.step()
        opt.zero_grad()
    return fwd_bwd.seconds, step.seconds


def _bench(cfg_kwargs, batch, steps, warmup):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from minidist.models import GPTConfig, TinyGPT, gpt_batch
    from minidist.runtime import device
    from minidist.tensor_parallel import tensor_parallel_gpt, torch_parallelize
    cfg = GPTConfig(**cfg_kwargs)
    ref = TinyGPT(cfg)
    ids, targets = gpt_batch(0, batch, cfg.seq_len, cfg.vocab)
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    impls = {}
    for sp in (False, True):
        tag = " + SP" if sp else ""
        impls["torch TP" + tag] = (torch_parallelize(copy.deepcopy(ref), mesh, sequence_parallel=sp), False)
        impls["minidist TP" + tag] = (tensor_parallel_gpt(ref, sequence_parallel=sp), True)
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, (m, _) in impls.items()}
    times = {k: [] for k in impls}
    for step in range(warmup + steps):
        for name, (model, ours) in impls.items():
            dist.barrier()
            t = _step(model, opts[name], ids, targets, ours)
            if step >= warmup:
                times[name].append(t)
    return times


def run(args) -> list[dict]:
    from minidist.runtime import launch
    rows = []
    for t in (int(w) for w in args.world_sizes.split(",")):
        cfg = dict(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                   seq_len=args.seq)
        out = launch(_bench, t, cfg, args.batch, args.steps, args.warmup, timeout=600)
        med = {k: [statistics.median(max(o[k][i][j] for o in out) for i in range(args.steps)) for j in (0, 1)]
               for k in out[0]}
        for name, (fwd_bwd, step) in med.items():
            base = med[name.replace("minidist", "torch")][1]
            rows.append({"implementation": name, "t": t, "step_ms": 1e3 * step, "fwd_bwd_ms": 1e3 * fwd_bwd,
                         "vs_torch": step / base, "target": "<= 1.1" if name.startswith("minidist") else ""})
    return rows
