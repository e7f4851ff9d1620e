"""Lab 8's cases: the models, batches and references its checks compare against.

Micikevicius et al. 2018 (*Mixed Precision Training*: fp16 weights and gradients, an fp32
master copy, loss scaling); Rajbhandari et al. 2019 (ZeRO: 2 + 2 + 12 bytes per parameter
with Adam, ZeRO-1 keeps 12/N of them per rank); Chen et al. 2016 and Korthikanti et al. 2022
(full and selective activation recomputation). References are built from torch alone: the
step's fp32 *shadow* and plain fp32 training of the same model in one process, which mixed
precision must follow within ``VS_FP32``. Used by the judged runners in
:mod:`minidist.checks.lab8_ranks` and :mod:`minidist.checks.lab8_here`, and by
:mod:`minidist.checks.lab8_memory`, which launches and reports.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist import cost
from minidist.checks.kit.launch import TOL
from minidist.checks.kit.returned import tensor_problem
from minidist.runtime import device as rank_device

WORLD, BATCH, D_IN, D_HID, D_OUT = 4, 12, 4, 5, 3      # Ψ = 4·5 + 5 + 5·3 + 3 = 43: uneven over 2, 3 and 4 ranks
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
LOW = {"fp16": F16, "bf16": BF16}
#: mixed precision against fp32 training in one process, after a few SGD/Adam steps: |master − fp32| ≤ this
#: (relative to the weights' scale above 1); measured at most 2.2e-4 (fp16) and 1.7e-3 (bf16) on these cases
VS_FP32 = {F16: 2e-3, BF16: 2e-2}
ADAM_LR, SGD_LR = 1e-2, 0.1


def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The lab's sharding: chunks of ceil(numel / N), the last ones shorter (as the notebook hands out)."""
    size = -(-numel // world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


# ----------------------------------------------------------------------------- models, data, scaler
def make_models(dtype, device):
    """(fp32 model on the CPU, the same weights in ``dtype`` on ``device``)."""
    g = torch.Generator().manual_seed(8)
    ref = nn.Sequential(nn.Linear(D_IN, D_HID, device="cpu"), nn.Tanh(), nn.Linear(D_HID, D_OUT, device="cpu"))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * 0.7)
    low = nn.Sequential(nn.Linear(D_IN, D_HID, device=device), nn.Tanh(), nn.Linear(D_HID, D_OUT, device=device))
    low.to(dtype)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), low.parameters()):
            b.copy_(a)
    return ref, low


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", F32) for t in tensors])


def batch(step: int, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    x, y = (torch.randn(n, generator=g, device="cpu") for n in ((BATCH, D_IN), (BATCH, D_OUT)))
    return x.to(device), y.to(device)


def loss_of(model, x, y, dtype):
    """Mean squared error, computed in fp32 from the model's low-precision output."""
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def make_optimizer(kind: str, params):
    return torch.optim.Adam(params, lr=ADAM_LR) if kind == "adam" else torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


class ReferenceScaler:
    """The lab's DynamicLossScaler, as the checks hand it to the step functions (the contract
    of the notebook: ``loss_scale``, ``scale``, ``unscale_`` agreeing over ``group``, ``update``)."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 group=None):
        self.loss_scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.group, self.good = growth_interval, group, 0

    def scale(self, loss):
        return loss * self.loss_scale

    def found_inf(self, grads) -> bool:
        return any(not torch.isfinite(g).all() for g in grads)

    def unscale_(self, params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            g.mul_(1.0 / self.loss_scale)
        bad = torch.tensor([float(self.found_inf(grads))], device=rank_device())
        if self.group is not False:                         # False: the checks' own shadow, no communication
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bool(bad.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.loss_scale *= self.backoff_factor
            self.good = 0
        else:
            self.good += 1
            if self.good == self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.good = 0


def scale_history(flags, **kw) -> list[float]:
    """The loss scale after each ``update(flag)`` of the reference."""
    s = ReferenceScaler(group=False, **kw)
    out = []
    for f in flags:
        s.update(f)
        out.append(s.loss_scale)
    return out


# ----------------------------------------------------------------------------- comparisons
def err(what, got, want, tol: float = TOL) -> str | None:
    """Why ``got`` is not ``want`` (None if it is, within ``tol`` relative to its scale above 1)."""
    if problem := tensor_problem(what, got, want):
        return problem
    got, want = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    if not torch.isfinite(want).all():
        return None if torch.equal(torch.isfinite(got), torch.isfinite(want)) else f"{what}: finite where it must not be"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= tol * scale:             # NaN fails too
        return f"{what} differs from the reference (max |error| {diff:.3g}, scale {scale:.3g}, tolerance {tol:g})"
    return None


def collectives(tr) -> list[str]:
    return [e.op for e in tr.comm()]


# ----------------------------------------------------------------------------- model-state bytes
def expected_bytes(psi: int, shard: int, tensors: int, precision: str) -> dict:
    """Model states per rank with Adam, by :func:`minidist.cost.mixed_precision_memory_bytes`: 16-bit
    weights and gradients whole (2 + 2 bytes per parameter), K = 12 bytes for this rank's ``shard`` of
    fp32 master weights (4, counted with the weights here) and both moments (8); plus Adam's 4-byte
    step counter per master tensor."""
    per = cost.mixed_precision_memory_bytes(precision, 0, 1)          # bytes per parameter, unsharded
    master = 4
    return {"params": int(per["params"] * psi + master * shard), "grads": int(per["grads"] * psi),
            "optimizer": int((per["optimizer"] - master) * shard + 4 * tensors)}


# ----------------------------------------------------------------------------- recomputation, in this process
def expected_saved(policy: str, layers: int, b, s, d, heads, d_ff, dropout: bool, elem: int = 4) -> int:
    """Bytes a stack of GPT blocks saves for backward under ``policy``, by
    :func:`minidist.cost.activation_bytes` (Korthikanti et al. 2022's count for these blocks as they
    run; on the CPU a dropout mask is a tensor of the activations' dtype, ``elem`` bytes an element)."""
    per_layer = cost.activation_bytes(policy, s, b, d, heads, dropout=dropout, elem_bytes=elem, mask_bytes=elem,
                                      stat_bytes=4, d_ff=d_ff)
    return int(layers * per_layer)
