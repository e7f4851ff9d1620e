"""Lab 8's answers, the only code of its checks that calls student code: what the student's scaler,
steps and ``recompute_blocks`` did on one case, as plain data.

In this process (the whole answer runs as one graded call): the scaler's bookkeeping, and
``recompute_blocks`` forward and backward. On a rank of a group (:class:`~minidist.checks.kit.run.OnRank`):
the scaler's ``unscale_``, and two or three training steps through a step function, recording
after each what the verdict needs. A rank stops at the first step its verdict fails, as every rank
of a correct solution goes on (a step that went wrong would make the next ones meaningless).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.checks.kit.compare import digest, on_rank, traffic
from minidist.checks.kit.raises import outcome
from minidist.checks.kit.raises import attempt
from minidist.checks.kit.launch import one_thread
from minidist.checks.kit.returned import returned
from minidist.checks.kit.run import RankCase, every_rank_passed
from minidist.checks.lab8_memory import verdicts
from minidist.checks.lab8_memory.cases import (FLAGS, LOW, SCALER, SGD_LR, ReferenceScaler, batch, blocks_and_input,
                                               flat, loss_of, make_models, make_optimizer, run_blocks, scaler_grads,
                                               shard_bounds)
from minidist.memory import model_state_bytes
from minidist.runtime import device as rank_device
from minidist.trace import trace


# ----------------------------------------------------------------------------- the scaler, in this process
def scaler(cls, case) -> dict:
    """The scaler's loss scale at the start, ``scale(loss)`` and its gradient, the scale after each
    update of FLAGS, or what the constructor did with bad arguments."""
    kind, kw = case
    if kind == "bad":
        return outcome(lambda: cls(**kw))
    s = cls(**kw)
    if kind == "start":
        return {"scale": returned(getattr(s, "loss_scale", None), f"{SCALER}.loss_scale")}
    if kind == "history":
        scales = []
        for f in FLAGS:
            s.update(f)
            scales.append(returned(getattr(s, "loss_scale", None), f"{SCALER}.loss_scale"))
        return {"scales": scales}
    w = torch.tensor(3.0, device="cpu", requires_grad=True)
    scaled = s.scale(w * 2.0)
    if type(scaled) is not torch.Tensor or scaled.grad_fn is None:
        return {"scaled": type(scaled).__name__}
    scaled.backward()
    return {"scaled": scaled.detach(), "grad": w.grad}


# ----------------------------------------------------------------------------- recomputation, in this process
def recompute(fn, case) -> dict:
    """The blocks run through ``fn`` from random state 11: output, saved bytes, random state after,
    every gradient, and digests of the caller's input and weights (which must come back unchanged)."""
    _, model, x0 = blocks_and_input(case)
    blocks = model.blocks
    if case.get("raises"):
        return outcome(lambda: fn(blocks, x0.clone().requires_grad_(), case["policy"]))
    x = x0.clone().requires_grad_()
    with one_thread():
        y, saved, rng = run_blocks(lambda b, x: fn(b, x, case["policy"]), blocks, x, 11)
    return {"y": y, "saved": saved, "rng": rng, "x": digest(x), "x_grad": x.grad,
            "grads": [p.grad for p in blocks.parameters()], "weights": [digest(p) for p in blocks.parameters()]}


# ----------------------------------------------------------------------------- unscale_, on ranks
def unscale(cls, case, on) -> dict:
    """This rank's scaled gradients (an inf, NaN or -inf on one rank only), unscaled by the student's
    scaler: what it returned, its traffic, the gradients and whether each stayed the same tensor."""
    dev, dtype = rank_device(), case["dtype"]
    s = cls(init_scale=case.get("scale", 2.0 ** 10), group=on.group)
    grads, shapes = scaler_grads(case, on.r, on.t)
    params = [torch.zeros(shape, device=dev, dtype=dtype, requires_grad=True) for shape in shapes]
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else on_rank(grad)
    bad_rank = case.get("bad_rank")
    in_bad_group = case.get("bad_group") in (None, dist.get_rank() // on.t)     # groups are consecutive ranks
    if bad_rank is not None and on.r == bad_rank % on.t and in_bad_group:
        params[0].grad[1, 2] = case.get("bad", float("inf"))
    ptrs = [None if p.grad is None else p.grad.data_ptr() for p in params]
    with trace() as tr:
        found = s.unscale_(params)
    flag = found if isinstance(found, bool) or (isinstance(found, torch.Tensor) and found.numel() == 1) else None
    return {"found": None if flag is None else bool(flag), "shown": repr(found)[:80], "traffic": traffic(tr),
            "grads": [p.grad for p in params],
            "in_place": [p.grad is not None and p.grad.data_ptr() == ptr for p, ptr in zip(params, ptrs)]}


# ----------------------------------------------------------------------------- the two steps, on ranks
def _poison(params, k: int) -> None:
    """Set element k of the flattened gradients to inf."""
    for p in params:
        if k < p.numel():
            with torch.no_grad():
                p.grad.view(-1)[k] = float("inf")
            return
        k -= p.numel()


def _gathered_grads(params, group, t) -> list[torch.Tensor]:
    """Every rank's low-precision gradient as fp32 on the CPU (the check's own all-gather)."""
    mine = torch.cat([p.grad.detach().reshape(-1).float() for p in params])
    if t == 1:
        return [mine.cpu()]
    out = [torch.empty_like(mine) for _ in range(t)]
    dist.all_gather(out, mine, group=group)
    return [o.cpu() for o in out]


def step(fn, case, on, sharded: bool) -> dict:
    """Two or three training steps through the student's step; after each, what the verdict needs:
    the gradients every rank held before it, what it returned, the loss scale, the master and
    model weights, gradients left, the bytes held before and after."""
    r, t, group = on
    if case.get("raises"):
        return _bad_step(fn, r, t, group, sharded)
    dev, dtype = rank_device(), LOW[case["dtype"]]
    ref, low = make_models(dtype, dev)
    params = list(low.parameters())
    psi = sum(p.numel() for p in params)
    start, end = shard_bounds(psi, r, t) if sharded else (0, psi)
    flat0 = flat(ref.parameters())
    master = ([on_rank(flat0[start:end], grad=True)] if sharded
              else [on_rank(p, grad=True) for p in ref.parameters()])
    opt = make_optimizer(case["opt"], master)
    scaler = ReferenceScaler(init_scale=2.0 ** 12, growth_interval=2, group=group) if case["scaler"] else None
    bad_step, bad_rank = case.get("overflow", (None, None))
    answer = {"steps": []}
    for i in range(case.get("steps", 2)):
        x, y = batch(i)
        loss = loss_of(low, *(v.tensor_split(t)[r].to(dev) for v in (x, y)), dtype)
        (scaler.scale(loss) if scaler else loss).backward()
        if i == bad_step and r == bad_rank % t:
            # an overflow in this rank's gradient only, at an element that another rank's shard holds
            _poison(params, shard_bounds(psi, (bad_rank + 1) % t, t)[0] if sharded else psi - 1)
        grads = _gathered_grads(params, group, t)
        before = model_state_bytes(params + master, opt) if i >= 1 else None
        stepped = fn(low, master if not sharded else master[0], opt, scaler, group)
        answer["steps"].append({
            "grads": grads, "stepped": stepped if isinstance(stepped, bool) else repr(stepped)[:80],
            "scale": scaler.loss_scale if scaler is not None else None, "master": flat(master),
            "model": flat(params), "grads_left": any(p.grad is not None for p in params + master),
            "before": before, "after": model_state_bytes(params + master, opt)})
        passed = verdicts.progress(RankCase(case, dist.get_rank(), r, t), answer, sharded) is None
        if not every_rank_passed(passed, group):     # the group stops together, never one rank in a step alone
            break
    return answer


def _bad_step(fn, r, t, group, sharded: bool) -> dict:
    """Masters that do not fit the model (one element too many, or one tensor missing)."""
    dev, dtype = rank_device(), LOW["bf16"]
    ref, low = make_models(dtype, dev)
    psi = sum(p.numel() for p in low.parameters())
    if sharded:
        s, e = shard_bounds(psi, r, t)
        master = torch.zeros(e - s + 1, device=dev, requires_grad=True)
        opt = torch.optim.SGD([master], lr=SGD_LR)
    else:
        master = [on_rank(p, grad=True) for p in ref.parameters()][:-1]
        opt = torch.optim.SGD(master, lr=SGD_LR)
    loss_of(low, *batch(0, dev), dtype).backward()
    return attempt(fn, (low, master, opt, None, group))
