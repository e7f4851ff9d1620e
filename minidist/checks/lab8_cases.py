"""Lab 8's cases: the models, batches and references its checks compare against.

Micikevicius et al. 2018 (*Mixed Precision Training*: fp16 weights and gradients, an fp32
master copy, loss scaling); Rajbhandari et al. 2019 (ZeRO: 2 + 2 + 12 bytes per parameter
with Adam, ZeRO-1 keeps 12/N of them per rank); Chen et al. 2016 and Korthikanti et al. 2022
(full and selective activation recomputation). A runner takes (fn, case, group rank r, group
size t, group) and returns a list of problems (None where all is well). References are built
from torch alone: a *shadow* of the step in fp32 on the CPU, fed with every rank's actual
low-precision gradients (the check gathers them before the student's step), so the student's
master weights must equal it up to fp32 summation order; and plain fp32 training of the same
model in one process, which mixed precision must follow within a stated tolerance.
Used by :mod:`minidist.checks.lab8_memory`, which launches and reports.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist import cost
from minidist.checks.common import TOL
from minidist.checks.returned import not_plain_tensor
from minidist.memory import model_state_bytes
from minidist.runtime import device as rank_device
from minidist.trace import trace

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
    if problem := not_plain_tensor(what, got, want.shape):
        return problem
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
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


# ----------------------------------------------------------------------------- the loss scaler, on ranks
def run_scaler(cls, case, r, t, group):
    """unscale_: every gradient divided by the scale in place, found_inf the same on every rank
    (an inf or NaN on one rank only), one all-reduce."""
    dev = rank_device()
    dtype, scale = case["dtype"], case.get("scale", 2.0 ** 10)
    scaler = cls(init_scale=scale, group=group)
    g = torch.Generator().manual_seed(10 * t + r)
    params = [torch.zeros(s, device=dev, dtype=dtype, requires_grad=True) for s in ((3, 4), (5,), (2,))]
    for i, p in enumerate(params):
        if i != case.get("no_grad", -1):
            p.grad = (torch.randn(p.shape, generator=g, device="cpu") * scale).to(dev, dtype)
    want = [None if p.grad is None else (p.grad.double() / scale) for p in params]
    bad_rank = case.get("bad_rank")
    if bad_rank is not None and r == bad_rank % t:
        params[0].grad[1, 2] = case.get("bad", float("inf"))
    ptrs = [None if p.grad is None else p.grad.data_ptr() for p in params]
    with trace() as tr:
        found = scaler.unscale_(params)
    problems = []
    expect = bad_rank is not None
    if not isinstance(found, (bool, torch.Tensor)) or bool(found) != expect:
        where = f"group rank {bad_rank % t} only" if expect else "no rank"
        problems.append(f"unscale_ returned {found!r}, expected {expect} (a non-finite gradient on {where}): "
                        f"every rank must agree")
    ops = collectives(tr)
    if t > 1 and ops.count("all_reduce") != 1 or len(ops) > 1:
        problems.append(f"unscale_ must agree with exactly one all-reduce (of a flag), it called {ops or 'nothing'}")
    for i, (p, w, ptr) in enumerate(zip(params, want, ptrs)):
        if w is None:
            problems.append(None if p.grad is None else f"param {i} had no gradient and now has one")
            continue
        if p.grad is None or p.grad.data_ptr() != ptr:
            problems.append(f"param {i}'s gradient must be unscaled in place (the same tensor, divided by the scale)")
            continue
        if not expect or (i != 0):
            tol = TOL if dtype == F32 else torch.finfo(dtype).eps
            problems.append(err(f"param {i}'s unscaled gradient", p.grad, w, tol))
    return problems


# ----------------------------------------------------------------------------- the two steps, on ranks
def run_step(fn, case, r, t, group, sharded: bool):
    """Two or three training steps through the student's step: master weights against the fp32
    shadow fed with every rank's gradients, the model's weights against the masters (the copy
    back), the loss scale, gradients freed, the bytes held before and after (Adam), and, where
    the case asks, against fp32 training in one process."""
    dev, dtype = rank_device(), LOW[case["dtype"]]
    ref, low = make_models(dtype, dev)
    params = list(low.parameters())
    psi = sum(p.numel() for p in params)
    start, end = shard_bounds(psi, r, t) if sharded else (0, psi)
    flat0 = flat(ref.parameters())
    if sharded:
        master = [flat0[start:end].clone().to(dev).requires_grad_()]
    else:
        master = [p.detach().clone().to(dev).requires_grad_() for p in ref.parameters()]
    opt = make_optimizer(case["opt"], master)
    scaler = ReferenceScaler(init_scale=2.0 ** 12, growth_interval=2, group=group) if case["scaler"] else None
    shadow = flat0.clone().requires_grad_()
    shadow_opt = make_optimizer(case["opt"], [shadow])
    shadow_scaler = ReferenceScaler(init_scale=2.0 ** 12, growth_interval=2, group=False)
    fp32_opt = make_optimizer(case["opt"], ref.parameters())
    problems = []
    bad_step, bad_rank = case.get("overflow", (None, None))
    for step in range(case.get("steps", 2)):
        x, y = batch(step)
        mine = [v.tensor_split(t)[r].to(dev) for v in (x, y)]
        loss = loss_of(low, *mine, dtype)
        (scaler.scale(loss) if scaler else loss).backward()
        if step == bad_step and r == bad_rank % t:
            # an overflow in this rank's gradient only, at an element that another rank's shard holds
            _poison(params, shard_bounds(psi, (bad_rank + 1) % t, t)[0] if sharded else psi - 1)
        grads = _gathered_grads(params, group, t, dev)
        before = model_state_bytes(params + master, opt) if step >= 1 else None
        stepped = fn(low, master if not sharded else master[0], opt, scaler, group)
        after = model_state_bytes(params + master, opt)
        # the shadow: mean of every rank's fp32 gradient, unscaled, checked, stepped
        mean = sum(grads) / t
        if scaler is not None:
            mean = mean * (1.0 / shadow_scaler.loss_scale)
        found = scaler is not None and not torch.isfinite(mean).all().item()
        if not found:
            shadow.grad = mean
            shadow_opt.step()
            fp32_opt.zero_grad()
            loss_of(ref, x, y, F32).backward()
            fp32_opt.step()
        if scaler is not None:
            shadow_scaler.update(found)
        label = f"step {step}{' (overflow injected on group rank ' + str(bad_rank % t) + ')' if step == bad_step else ''}"
        if not isinstance(stepped, bool) or stepped != (not found):
            problems.append(f"{label}: returned {stepped!r}, expected {not found} (True when the optimizer stepped)")
        if scaler is not None and scaler.loss_scale != shadow_scaler.loss_scale:
            problems.append(f"{label}: loss scale {scaler.loss_scale:g} afterwards, expected {shadow_scaler.loss_scale:g} "
                            f"(call scaler.update(found_inf) once per step)")
        got = flat(master)
        problems.append(err(f"{label}: master weights" + (f" [{start}:{end}]" if sharded else ""), got,
                            shadow.detach()[start:end]))
        low_flat = flat(params)
        if not torch.equal(low_flat[start:end], got.to(dtype).float()):
            problems.append(f"{label}: the model's {case['dtype']} weights" + (f" [{start}:{end}]" if sharded else "")
                            + " are not your master weights cast to " + case["dtype"] + " (copy them back after the step)")
        if sharded:
            eps = torch.finfo(dtype).eps
            problems.append(err(f"{label}: the model's weights outside your shard (all-gathered)", low_flat,
                                shadow.detach().to(dtype).float(), 2 * eps))
        if any(p.grad is not None for p in params + master):
            problems.append(f"{label}: gradients left after the step (set the model's and the masters' .grad to None)")
        problems += _bytes(label, before, after, psi, end - start, len(master), case)
        if any(problems):
            return problems
    if case.get("vs_fp32"):
        problems.append(err(f"after {case.get('steps', 2)} steps: master weights vs fp32 training in one process",
                            flat(master), flat(ref.parameters())[start:end], VS_FP32[dtype]))
    return problems


def _poison(params, k: int) -> None:
    """Set element k of the flattened gradients to inf."""
    for p in params:
        if k < p.numel():
            with torch.no_grad():
                p.grad.view(-1)[k] = float("inf")
            return
        k -= p.numel()


def _gathered_grads(params, group, t, dev) -> list[torch.Tensor]:
    """Every rank's low-precision gradient as fp32 on the CPU (the check's own all-gather)."""
    mine = torch.cat([p.grad.detach().reshape(-1).float() for p in params]).to(dev)
    if t == 1:
        return [mine.cpu()]
    out = [torch.empty_like(mine) for _ in range(t)]
    dist.all_gather(out, mine, group=group)
    return [o.cpu() for o in out]


def expected_bytes(psi: int, shard: int, tensors: int, precision: str) -> dict:
    """Model states per rank with Adam, by :func:`minidist.cost.mixed_precision_memory_bytes`: 16-bit
    weights and gradients whole (2 + 2 bytes per parameter), K = 12 bytes for this rank's ``shard`` of
    fp32 master weights (4, counted with the weights here) and both moments (8); plus Adam's 4-byte
    step counter per master tensor."""
    per = cost.mixed_precision_memory_bytes(precision, 0, 1)          # bytes per parameter, unsharded
    master = 4
    return {"params": int(per["params"] * psi + master * shard), "grads": int(per["grads"] * psi),
            "optimizer": int((per["optimizer"] - master) * shard + 4 * tensors)}


def _bytes(label, before, after, psi, shard, tensors, case) -> list:
    if case["opt"] != "adam":
        return []
    want = expected_bytes(psi, shard, tensors, case["dtype"])
    out = []
    if before is not None and {k: before[k] for k in want} != want:
        out.append(f"{label}: before the step the rank held {before} bytes, expected {want} "
                   f"(2 + 2 + 12{'/N' if shard < psi else ''} per parameter)")
    want_after = dict(want, grads=0)
    if {k: after[k] for k in want_after} != want_after:
        out.append(f"{label}: after the step the rank held {after} bytes, expected {want_after} "
                   f"(gradients freed: 2 + 12{'/N' if shard < psi else ''} per parameter)")
    return out


def run_bad_step(fn, case, r, t, group, sharded: bool):
    """ValueError before any collective when the masters do not fit the model."""
    dev, dtype = rank_device(), LOW["bf16"]
    ref, low = make_models(dtype, dev)
    psi = sum(p.numel() for p in low.parameters())
    if sharded:
        s, e = shard_bounds(psi, r, t)
        master = torch.zeros(e - s + 1, device=dev, requires_grad=True)       # one element too many
        opt = torch.optim.SGD([master], lr=SGD_LR)
    else:
        master = [p.detach().clone().to(dev).requires_grad_() for p in ref.parameters()][:-1]    # one missing
        opt = torch.optim.SGD(master, lr=SGD_LR)
    loss_of(low, *batch(0, dev), dtype).backward()
    with trace() as tr:
        try:
            fn(low, master, opt, None, group)
        except ValueError:
            return [f"a ValueError, but after {collectives(tr)}: raise before any collective" if tr.comm() else None]
    return ["masters that do not fit the model must raise ValueError" + (f" (your step called {collectives(tr)})"
                                                                          if tr.comm() else "")]


CASE_RUNNERS = {
    "DynamicLossScaler": run_scaler,
    "mixed_precision_step": lambda fn, case, r, t, g: (run_bad_step if case.get("raises") else run_step)(
        fn, case, r, t, g, False),
    "zero1_mixed_precision_step": lambda fn, case, r, t, g: (run_bad_step if case.get("raises") else run_step)(
        fn, case, r, t, g, True),
}


# ----------------------------------------------------------------------------- recomputation, in this process
def expected_saved(policy: str, layers: int, b, s, d, heads, d_ff, dropout: bool, elem: int = 4) -> int:
    """Bytes a stack of GPT blocks saves for backward under ``policy``, by
    :func:`minidist.cost.activation_bytes` (Korthikanti et al. 2022's count for these blocks as they
    run; on the CPU a dropout mask is a tensor of the activations' dtype, ``elem`` bytes an element)."""
    per_layer = cost.activation_bytes(policy, s, b, d, heads, dropout=dropout, elem_bytes=elem, mask_bytes=elem,
                                      stat_bytes=4, d_ff=d_ff)
    return int(layers * per_layer)
