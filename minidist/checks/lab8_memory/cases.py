"""Lab 8's cases: the visible case tables (the hidden ones are the grader's, in ``hidden.py``), the
models, batches and inputs every case draws from its seeds, the checks' own loss scaler, and what a
passing test's ✓ line says it covered.

Micikevicius et al. 2018 (*Mixed Precision Training*: fp16 weights and gradients, an fp32 master
copy, loss scaling); Rajbhandari et al. 2019 (ZeRO: 2 + 2 + 12 bytes per parameter with Adam,
ZeRO-1 keeps 12/N of them per rank); Chen et al. 2016 and Korthikanti et al. 2022 (full and
selective activation recomputation). The steps train a 43-parameter MLP (uneven shards over 2, 3
and 4 ranks); ``recompute_blocks`` runs two or three GPT blocks in this process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.checks.kit.compare import seeded
from minidist.checks.kit.withheld import hidden_cases
from minidist.memory import ActivationMeter, model_state
from minidist.models import TinyGPT
from minidist.runtime import device as rank_device

WORLD, BATCH, D_IN, D_HID, D_OUT = 4, 12, 4, 5, 3      # Ψ = 4·5 + 5 + 5·3 + 3 = 43: uneven over 2, 3 and 4 ranks
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
LOW = {"fp16": F16, "bf16": BF16}
#: mixed precision against fp32 training in one process, after a few SGD/Adam steps: |master − fp32| ≤ this
#: (relative to the weights' scale above 1); measured at most 2.2e-4 (fp16) and 1.7e-3 (bf16) on these cases
VS_FP32 = {F16: 2e-3, BF16: 2e-2}
ADAM_LR, SGD_LR = 1e-2, 0.1
GRADED = ("DynamicLossScaler", "mixed_precision_step", "zero1_mixed_precision_step", "recompute_blocks")
SCALER = "DynamicLossScaler"
#: the flags fed to update() in the scaler's history cases: growth twice in a row at the end
FLAGS = [False] * 4 + [True] + [False] * 2 + [True, True] + [False] * 7


def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The lab's sharding: chunks of ceil(numel / N), the last ones shorter (as the notebook hands out)."""
    size = -(-numel // world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


# ----------------------------------------------------------------------------- the case tables
def scaler_cases(hidden: bool) -> list[tuple]:
    """The scaler's bookkeeping, in this process: (kind, constructor keywords)."""
    settings = [dict(init_scale=8.0, growth_interval=3)]
    bad = []
    if hidden:
        h = hidden_cases(__package__, SCALER)
        settings, bad = settings + h.SCALER_SETTINGS, h.SCALER_BAD
    return [("start", {}), ("scale", {})] + [("history", kw) for kw in settings] + [("bad", kw) for kw in bad]


def unscale_cases(hidden: bool) -> list[dict]:
    """The scaler's ``unscale_`` on groups of t ranks: an inf, NaN or -inf on one rank only."""
    h = hidden_cases(__package__, SCALER) if hidden else None
    ts = h.TS if hidden else (2, 4)
    cases = [dict(t=t, dtype=F32, **v) for t in ts for v in ({}, {"bad_rank": 0})]
    # an overflow in the first group only: the other group must not skip (agreement within a group)
    cases += [dict(t=2, dtype=F32, bad_rank=1, bad_group=0)]
    return cases + (h.UNSCALE if hidden else [])


def step_cases(hidden: bool) -> list[dict]:
    """Either step on groups of t ranks (the same table for both)."""
    if hidden:
        return hidden_cases(__package__, "mixed_precision_step / zero1_mixed_precision_step").STEPS
    # an inf in the last rank's gradient at the second step: every rank skips it (ZeRO-1: whatever shard holds it)
    return ([dict(t=t, dtype="fp16", scaler=True, opt="sgd") for t in (2, 4)]
            + [dict(t=2, dtype="fp16", scaler=True, opt="sgd", steps=2, overflow=(1, 1))]
            + [dict(t=t, dtype="bf16", scaler=False, opt="adam") for t in (2, 4)])


def recompute_cases(hidden: bool) -> list[dict]:
    cases = [dict(policy=p, dropout=0.1) for p in ("full", "selective")]
    return cases + (hidden_cases(__package__, "recompute_blocks").RECOMPUTE if hidden else [])


#: the ✓ line of each visible check (the hidden ones': hidden.COVERED)
COVERED = {
    "DynamicLossScaler": ("scale, update's history, unscale_ in place on t=2,4 with an inf on one rank, "
                          "and an inf in one group only (the other group must not skip)"),
    "mixed_precision_step": ("t=2,4: fp16+scaler+SGD (an inf on one rank: skipped on every rank), bf16+Adam vs "
                             "the fp32 shadow; bytes 2+2+12 / 2+12"),
    "zero1_mixed_precision_step": ("t=2,4, uneven shards: fp16+scaler+SGD (an inf on one rank: skipped on every "
                                   "rank), bf16+Adam; bytes 2+2+12/N / 2+12/N"),
    "recompute_blocks": "full, selective with dropout: output, grads, RNG, saved bytes = formula",
}


def covered(name: str, hidden: bool) -> str:
    return hidden_cases(__package__, name).COVERED[name] if hidden else COVERED[name]


# ----------------------------------------------------------------------------- the steps' model, data, scaler
def make_models(dtype, device):
    """(fp32 model on the CPU, the same weights in ``dtype`` on ``device``)."""
    ref = nn.Sequential(nn.Linear(D_IN, D_HID, device="cpu"), nn.Tanh(), nn.Linear(D_HID, D_OUT, device="cpu"))
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p.copy_(seeded(p.shape, 80 + i) * 0.7)
    low = nn.Sequential(nn.Linear(D_IN, D_HID, device=device), nn.Tanh(), nn.Linear(D_HID, D_OUT, device=device))
    low.to(dtype)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), low.parameters()):
            b.copy_(a)
    return ref, low


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", F32) for t in tensors])


def batch(step: int, device="cpu"):
    return seeded((BATCH, D_IN), 100 + step).to(device), seeded((BATCH, D_OUT), 200 + step).to(device)


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


def scaler_grads(case: dict, r: int, t: int):
    """Every parameter's scaled gradient as group rank r draws it for ``unscale_`` (None for the
    case's missing one), and the parameters' shapes."""
    dtype, scale = case["dtype"], case.get("scale", 2.0 ** 10)
    shapes = ((3, 4), (5,), (2,))
    grads = [(seeded(s, 10 * (10 * t + r) + i, torch.float64) * scale).to(dtype) for i, s in enumerate(shapes)]
    return [None if i == case.get("no_grad", -1) else grad for i, grad in enumerate(grads)], shapes


# ----------------------------------------------------------------------------- recomputation's blocks and input
RECOMPUTE_CFG = dict(n_layers=2, d_model=16, n_heads=2, seq_len=8, vocab=8, seed=3)
RB = 2          # batch


def blocks_and_input(case: dict):
    """(the model's config, a TinyGPT whose blocks the case runs, the input x0), on the CPU."""
    cfg = dict(RECOMPUTE_CFG, n_layers=case.get("n_layers", 2), dropout=case["dropout"])
    return cfg, TinyGPT(device="cpu", **cfg), seeded((RB, cfg["seq_len"], cfg["d_model"]), 4)


def run_blocks(forward, blocks, x, seed: int, backward=None):
    """Forward (the bytes it saved for backward), then backward with a fixed upstream gradient, from
    random state ``seed``: (output, saved bytes, the random state afterwards)."""
    torch.manual_seed(seed)
    meter = ActivationMeter([t for b in blocks for t in model_state(b)])
    with meter.recording():
        y = forward(blocks, x)
    saved = meter.bytes
    upstream = seeded(tuple(y.shape), 5)
    (backward or (lambda y, g: y.backward(g)))(y, upstream)
    return y.detach(), saved, torch.get_rng_state()
