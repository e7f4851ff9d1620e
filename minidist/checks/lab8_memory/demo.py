"""Lab 8's measurements for its demo cells (not graded): the model-state bytes per parameter a rank
holds with the student's steps, and the bytes ``recompute_blocks`` keeps for backward and the FLOPs
its backward spends, each next to minidist's cost model."""
from __future__ import annotations

import copy

import torch

from minidist import cost
from minidist.checks.kit.compare import seeded
from minidist.checks.kit.groups import consecutive_groups
from minidist.checks.kit.launch import TIMEOUT, launch_named, mark_case, one_thread
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.lab8_memory.cases import WORLD, shard_bounds
from minidist.checks.lab8_memory.verdicts import expected_saved
from minidist.memory import ActivationMeter, model_state, model_state_bytes
from minidist.models import TinyGPT, gpt_batch, gpt_loss
from minidist.runtime import device


def _measure_body(progress, mixed_step, zero1_step, ts):
    groups = consecutive_groups(ts, WORLD)
    rows = []
    for t, kind in [(t, "mixed") for t in ts] + [(t, "zero1") for t in ts]:
        group, r, size = groups[t]
        mark_case(progress, f"{kind}, t={t}")
        model = TinyGPT(n_layers=2, device=device())
        low = copy.deepcopy(model).to(torch.bfloat16)
        psi = sum(p.numel() for p in model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if kind == "mixed":
            master = [p.detach().clone().requires_grad_() for p in model.parameters()]
        else:
            s, e = shard_bounds(psi, r, size)
            master = [flat[s:e].clone().requires_grad_()]
        opt = torch.optim.Adam(master, lr=1e-3)
        for step in range(2):
            ids, targets = (x.chunk(size)[r] for x in gpt_batch(step, 4, 16, model.cfg.vocab, device=device()))
            gpt_loss(low(ids).float(), targets).backward()
            before = model_state_bytes(list(low.parameters()) + master, opt)["total"]
            if kind == "mixed":
                mixed_step(low, master, opt, None, group)
            else:
                zero1_step(low, master[0], opt, None, group)
        after = model_state_bytes(list(low.parameters()) + master, opt)["total"]
        stage = 0 if kind == "mixed" else 1
        full = cost.mixed_precision_bytes_per_param("bf16", stage, size)
        rows += [dict(step=kind, t=size, rank=r, phase="after backward", per_param=before / psi, formula=full),
                 dict(step=kind, t=size, rank=r, phase="after step", per_param=after / psi, formula=full - 2)]
    return rows


@passes_quietly
def measure_bytes(mixed_precision_step, zero1_mixed_precision_step, ts=(1, 2, 4),
                  timeout: float = TIMEOUT) -> list[dict]:
    """Model-state bytes per parameter that rank 0 holds before and after the second bf16 Adam step of a
    TinyGPT (Ψ ≈ 30k) with your steps, section 3's (data parallel: 2 + 2 + 12 whatever N) and ZeRO-1
    at each N in ``ts``; next to :func:`minidist.cost.mixed_precision_bytes_per_param` (2 + 2 + 12/N
    for ZeRO-1, and 2 less after the step)."""
    out = launch_named(_measure_body, WORLD, mixed_precision_step, zero1_mixed_precision_step, tuple(ts),
                       name="measure_bytes", timeout=timeout)
    return [row for row in out[0]]


@passes_quietly
def measure_recompute(recompute_blocks, seqs=(32, 128), layers: int = 4, d_model: int = 64, heads: int = 4,
                      b: int = 4) -> list[dict]:
    """In this process, per sequence length and policy: bytes your ``recompute_blocks`` keeps for backward
    (``ActivationMeter``) next to :func:`minidist.cost.activation_bytes`, and the matmul FLOPs its backward
    spends beyond the plain run's (``torch.utils.flop_counter``) next to :func:`minidist.cost.recompute_flops`."""
    from torch.utils.flop_counter import FlopCounterMode
    rows = []
    with one_thread():
        for s in seqs:
            model = TinyGPT(n_layers=layers, d_model=d_model, n_heads=heads, seq_len=s, dropout=0.1, device="cpu")
            x0 = seeded((b, s, d_model), 0)
            plain_backward = None
            for policy in ("none", "selective", "full"):
                x = x0.clone().requires_grad_()
                meter = ActivationMeter([t for blk in model.blocks for t in model_state(blk)])
                with meter.recording():
                    y = recompute_blocks(model.blocks, x, policy)
                saved = meter.bytes
                with FlopCounterMode(display=False) as flops:
                    y.sum().backward()
                back = flops.get_total_flops()
                plain_backward = back if policy == "none" else plain_backward
                rows.append(dict(s=s, policy=policy, saved=saved,
                                 saved_formula=expected_saved(policy, layers, b, s, d_model, heads, 4 * d_model, True),
                                 extra_flops=back - plain_backward,
                                 flops_formula=cost.recompute_flops(policy, b, s, d_model, layers)))
    return rows
