"""``minidist tour`` rows for memory beyond sharding (lecture 8): mixed precision under ZeRO,
each recomputation policy, optimizer-state offload.

* mixed precision (bf16 with ZeRO-1, fp16 with a loss scale and ZeRO-3; 4 ranks, one launch for
  both rows): the fp32 masters after 3 steps against fp32 single-process Adam from the same
  weights (``max_err``: ||Δ|| / ||the reference's update||, 16-bit forward and backward), and
  the model-state bytes per rank after backward against 2 + 2 + 12/N and 16/N bytes per parameter;
* recomputation (the reference TinyGPT with dropout, one process): saved activation bytes
  against :func:`minidist.cost.activation_bytes`, to the byte, and outputs and gradients
  against no recomputation (``max_err`` 0: the same masks replayed);
* offload: the fp32 masters on the host against the same reference, the bytes moved per step
  against 2 + 2 bytes per parameter.
"""
from __future__ import annotations

import functools

from minidist.tour import TourEntry

CFG = dict(vocab=37, d_model=16, n_heads=2, n_layers=2, seq_len=8)
BATCH, STEPS, LR = 8, 3, 1e-3
MIXED = {"bf16, ZeRO-1": ("bf16", 1), "fp16 + loss scale, ZeRO-3": ("fp16", 3)}
MIXED_TOL = 0.2         # ||Δ|| / ||update|| of 16-bit training; a skipped step alone is ~0.3


def _reference(dtype_name: str):
    """fp32 Adam on the full batch from the 16-bit-rounded initial weights: (initial, final) flat."""
    import torch

    from minidist.models import TinyGPT, flat_parameters, gpt_batch, gpt_loss
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model = TinyGPT(**CFG, device="cpu").to(dtype).float()
    init = flat_parameters(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids, tgt = gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"], device="cpu")
        gpt_loss(model(ids), tgt).backward()
        opt.step()
        opt.zero_grad()
    return init, flat_parameters(model)


def _relative(weights, ref, init) -> float:
    return ((weights - ref).norm() / (ref - init).norm()).item()


def _train(dtype_name: str, stage: int) -> dict:
    """Inside a rank: STEPS steps of ZeroMixedPrecision on this rank's slice of the batch."""
    import torch
    import torch.distributed as dist

    from minidist.memory_techniques import DynamicLossScaler, ZeroMixedPrecision, to_low_precision
    from minidist.models import TinyGPT, gpt_batch, gpt_loss, local_slice
    rank, n = dist.get_rank(), dist.get_world_size()
    model = to_low_precision(TinyGPT(**CFG), {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name])
    zero = ZeroMixedPrecision(model, stage, scaler=DynamicLossScaler(2.0 ** 10) if dtype_name == "fp16" else None,
                              lr=LR)
    numel = sum(p.numel() for p in model.parameters())
    for step in range(STEPS):
        ids, tgt = (local_slice(t, rank, n) for t in gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"]))
        zero.scale(gpt_loss(zero(ids), tgt)).backward()
        held = zero.state_bytes()["total"]
        zero.step()
        zero.zero_grad()
    return {"masters": torch.cat([m.reshape(-1).cpu() for m in zero.full_masters()]), "held": held, "numel": numel}


def _both() -> dict:
    return {name: _train(*how) for name, how in MIXED.items()}


@functools.lru_cache(maxsize=None)
def _mixed_launch(world_size: int):
    from minidist.runtime import import_optimizers_before_fork, launch, timed
    import_optimizers_before_fork()      # the ranks build optimizers: they inherit the import
    with timed() as elapsed:
        out = launch(_both, world_size, timeout=180)
    return out, elapsed.seconds


def mixed_precision_row(name: str, world_size: int = 4) -> dict:
    from minidist.cost import mixed_precision_memory_bytes
    out, seconds = _mixed_launch(world_size)
    dtype_name, stage = MIXED[name]
    init, ref = _reference(dtype_name)
    err = max(_relative(o[name]["masters"], ref, init) for o in out)
    held = max(o[name]["held"] for o in out)
    formula = mixed_precision_memory_bytes(dtype_name, stage, out[0][name]["numel"], world_size)["total"]
    per_param = formula / out[0][name]["numel"]
    return {"technique": f"mixed precision: {name}", "world_size": world_size, "max_err": err,
            "tolerance": MIXED_TOL, "bytes_per_rank": held, "bytes_theory": formula, "time_s": seconds,
            "passed": abs(held / formula - 1) <= 0.005,
            "note": (f"max_err = ||masters - fp32 reference|| / ||its update||; bytes = model states per rank "
                     f"after backward, {per_param:g} B/param by formula ({100 * (held / formula - 1):+.2f}%)")}


def recompute_row(policy: str) -> dict:
    import copy

    import torch

    from minidist.cost import activation_bytes, recompute_flops
    from minidist.memory import ActivationMeter, model_state
    from minidist.memory_techniques import recompute_blocks
    from minidist.models import GPTConfig, TinyGPT
    from minidist.runtime import timed
    cfg = GPTConfig(vocab=16, d_model=16, n_heads=2, n_layers=2, seq_len=8, dropout=0.1)
    base = TinyGPT(cfg, device="cpu")
    x0 = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1), device="cpu")
    runs = {}
    with timed("cpu") as elapsed:
        for p in ("none", policy):
            model, x = copy.deepcopy(base), x0.clone().requires_grad_()
            torch.manual_seed(7)
            meter = ActivationMeter(model_state(model))
            with meter.recording():
                y = recompute_blocks(model.blocks, x, p)
            saved = meter.bytes
            (y * y).sum().backward()
            runs[p] = (saved, [y.detach(), x.grad] + [q.grad for q in model.parameters() if q.grad is not None])
    err = max((a - b).abs().max().item() for a, b in zip(runs[policy][1], runs["none"][1], strict=True))
    formula = cfg.n_layers * activation_bytes(policy, cfg.seq_len, 2, cfg.d_model, cfg.n_heads, dropout=True,
                                              mask_bytes=4)
    flops = recompute_flops(policy, 2, cfg.seq_len, cfg.d_model, cfg.n_layers)
    return {"technique": f"recomputation: {policy}", "world_size": 1, "max_err": err, "tolerance": 0.0,
            "bytes_per_rank": runs[policy][0], "bytes_theory": formula, "time_s": elapsed.seconds,
            "passed": runs[policy][0] == formula,
            "note": (f"bytes = activations saved for backward (ActivationMeter) vs the formula, to the byte; "
                     f"max_err vs no recomputation (dropout replayed); +{flops:.0f} forward FLOPs per step")}


def offload_row() -> dict:
    import torch

    from minidist.cost import offload_memory_bytes, offload_traffic_bytes
    from minidist.memory_techniques import OffloadOptimizer, to_low_precision
    from minidist.models import TinyGPT, gpt_batch, gpt_loss
    from minidist.runtime import timed
    init, ref = _reference("bf16")
    model = to_low_precision(TinyGPT(**CFG, device="cpu"), torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    opt = OffloadOptimizer(model.parameters(), host="cpu", lr=LR)
    with timed("cpu") as elapsed:
        for step in range(STEPS):
            ids, tgt = gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"], device="cpu")
            gpt_loss(model(ids), tgt).backward()
            on_device = opt.device_bytes()["total"]
            opt.step()
    masters = torch.cat([m.detach().reshape(-1) for m in opt.masters])
    traffic = sum(opt.traffic.values())
    theory = offload_traffic_bytes(numel)["total"]
    return {"technique": "offload: Adam state on the host", "world_size": 1,
            "max_err": _relative(masters, ref, init), "tolerance": MIXED_TOL, "bytes_per_rank": traffic,
            "bytes_theory": theory, "time_s": elapsed.seconds,
            "passed": traffic == theory and on_device == offload_memory_bytes(numel)["device"],
            "note": (f"bytes = moved per step (bf16 grads down, weights up); the device holds {on_device} B "
                     f"(2 + 2 B/param), the host {opt.host_bytes()} B (12 B/param)")}


def tour_entries() -> list[TourEntry]:
    return ([TourEntry(f"mixed precision: {name}", 4, lambda name=name: mixed_precision_row(name), MIXED_TOL)
             for name in MIXED]
            + [TourEntry(f"recomputation: {p}", 1, lambda p=p: recompute_row(p), 0.0) for p in ("selective", "full")]
            + [TourEntry("offload: Adam state on the host", 1, offload_row, MIXED_TOL)])
