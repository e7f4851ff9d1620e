"""Lab 8's cases that run on ranks, judged: the scaler's ``unscale_`` and the two mixed-precision
steps. Each has an ``answer`` (run in the rank: the student's code and what it left behind, as
plain data) and a ``verdict`` (the references, from the case and the answer alone), so the
grader's judge gives every verdict again (:class:`minidist.checks.kit.groups.RankRunner`).

Micikevicius et al. 2018 (mixed precision: fp32 masters, loss scaling); Rajbhandari et al. 2019
(ZeRO-1: 2 + 2 + 12/N bytes per parameter with Adam). A step's verdict replays the fp32 *shadow*
of the step from the gradients every rank held before the student's step (the rank records
them: the check's own all-gather), so the student's master weights must equal it up to fp32
summation order; and it trains the same model in fp32 in one process, which mixed precision must
follow within ``VS_FP32``. A rank stops at the first step its verdict fails, as every rank of a
correct solution goes on. Data, models and comparisons: :mod:`minidist.checks.lab8_cases`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.checks.kit.launch import TOL
from minidist.checks.kit.groups import RankRunner, attempt, first_problem, raise_verdict
from minidist.checks.lab8_cases import (F32, LOW, SGD_LR, VS_FP32, ReferenceScaler, batch, collectives, err,
                                        expected_bytes, flat, loss_of, make_models, make_optimizer, shard_bounds)
from minidist.memory import model_state_bytes
from minidist.runtime import device as rank_device
from minidist.trace import trace


# ----------------------------------------------------------------------------- the loss scaler's unscale_
def _scaler_grads(case, r, t):
    """Every parameter's scaled gradient as this rank draws it (None for the case's missing one)."""
    dtype, scale = case["dtype"], case.get("scale", 2.0 ** 10)
    g = torch.Generator().manual_seed(10 * t + r)
    shapes = ((3, 4), (5,), (2,))
    grads = [(torch.randn(s, generator=g, device="cpu") * scale).to(dtype) for s in shapes]
    return [None if i == case.get("no_grad", -1) else grad for i, grad in enumerate(grads)], shapes


def scaler_answer(cls, case, r, t, group):
    dev, dtype = rank_device(), case["dtype"]
    scaler = cls(init_scale=case.get("scale", 2.0 ** 10), group=group)
    grads, shapes = _scaler_grads(case, r, t)
    params = [torch.zeros(s, device=dev, dtype=dtype, requires_grad=True) for s in shapes]
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else grad.to(dev)
    bad_rank = case.get("bad_rank")
    if bad_rank is not None and r == bad_rank % t:
        params[0].grad[1, 2] = case.get("bad", float("inf"))
    ptrs = [None if p.grad is None else p.grad.data_ptr() for p in params]
    with trace() as tr:
        found = scaler.unscale_(params)
    flag = found if isinstance(found, bool) or (isinstance(found, torch.Tensor) and found.numel() == 1) else None
    return {"found": None if flag is None else bool(flag), "shown": repr(found)[:80], "ops": collectives(tr),
            "grads": [p.grad for p in params],
            "in_place": [p.grad is not None and p.grad.data_ptr() == ptr for p, ptr in zip(params, ptrs)]}


def scaler_verdict(case, r, t, answer):
    """unscale_: every gradient divided by the scale in place, found_inf the same on every rank
    (an inf or NaN on one rank only), one all-reduce."""
    dtype, scale, bad_rank = case["dtype"], case.get("scale", 2.0 ** 10), case.get("bad_rank")
    problems, expect = [], bad_rank is not None
    if answer["found"] is None or answer["found"] != expect:
        where = f"group rank {bad_rank % t} only" if expect else "no rank"
        problems.append(f"unscale_ returned {answer['shown']}, expected {expect} (a non-finite gradient on {where}): "
                        f"every rank must agree")
    ops = answer["ops"]
    if t > 1 and ops.count("all_reduce") != 1 or len(ops) > 1:
        problems.append(f"unscale_ must agree with exactly one all-reduce (of a flag), it called {ops or 'nothing'}")
    for i, (want, got, in_place) in enumerate(zip(_scaler_grads(case, r, t)[0], answer["grads"], answer["in_place"])):
        if want is None:
            problems.append(None if got is None else f"param {i} had no gradient and now has one")
        elif got is None or not in_place:
            problems.append(f"param {i}'s gradient must be unscaled in place (the same tensor, divided by the scale)")
        elif not expect or i != 0:
            tol = TOL if dtype == F32 else torch.finfo(dtype).eps
            problems.append(err(f"param {i}'s unscaled gradient", got, want.double() / scale, tol))
    return problems


# ----------------------------------------------------------------------------- the two steps
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


def step_answer(fn, case, r, t, group, sharded: bool):
    """Two or three training steps through the student's step; after each, what the verdict needs:
    the gradients every rank held before it, what it returned, the loss scale, the master and
    model weights, gradients left, the bytes held before and after."""
    if case.get("raises"):
        return _bad_step_answer(fn, r, t, group, sharded)
    dev, dtype = rank_device(), LOW[case["dtype"]]
    ref, low = make_models(dtype, dev)
    params = list(low.parameters())
    psi = sum(p.numel() for p in params)
    start, end = shard_bounds(psi, r, t) if sharded else (0, psi)
    flat0 = flat(ref.parameters())
    master = ([flat0[start:end].clone().to(dev).requires_grad_()] if sharded
              else [p.detach().clone().to(dev).requires_grad_() for p in ref.parameters()])
    opt = make_optimizer(case["opt"], master)
    scaler = ReferenceScaler(init_scale=2.0 ** 12, growth_interval=2, group=group) if case["scaler"] else None
    bad_step, bad_rank = case.get("overflow", (None, None))
    answer = {"steps": []}
    for step in range(case.get("steps", 2)):
        x, y = batch(step)
        loss = loss_of(low, *(v.tensor_split(t)[r].to(dev) for v in (x, y)), dtype)
        (scaler.scale(loss) if scaler else loss).backward()
        if step == bad_step and r == bad_rank % t:
            # an overflow in this rank's gradient only, at an element that another rank's shard holds
            _poison(params, shard_bounds(psi, (bad_rank + 1) % t, t)[0] if sharded else psi - 1)
        grads = _gathered_grads(params, group, t, dev)
        before = model_state_bytes(params + master, opt) if step >= 1 else None
        stepped = fn(low, master if not sharded else master[0], opt, scaler, group)
        answer["steps"].append({
            "grads": grads, "stepped": stepped if isinstance(stepped, bool) else repr(stepped)[:80],
            "scale": scaler.loss_scale if scaler is not None else None, "master": flat(master),
            "model": flat(params), "grads_left": any(p.grad is not None for p in params + master),
            "before": before, "after": model_state_bytes(params + master, opt)})
        if first_problem(step_verdict(case, r, t, answer, sharded, partial=True)):
            break
    return answer


def step_verdict(case, r, t, answer, sharded: bool, partial: bool = False):
    if case.get("raises"):
        return raise_verdict(answer, "the master weights do not fit the model")
    dtype, steps = LOW[case["dtype"]], case.get("steps", 2)
    ref, _ = make_models(dtype, "cpu")
    psi = sum(p.numel() for p in ref.parameters())
    start, end = shard_bounds(psi, r, t) if sharded else (0, psi)
    masters = 1 if sharded else len(list(ref.parameters()))      # master tensors (Adam's step counters)
    shadow = flat(ref.parameters()).requires_grad_()
    shadow_opt, fp32_opt = make_optimizer(case["opt"], [shadow]), make_optimizer(case["opt"], ref.parameters())
    shadow_scaler = ReferenceScaler(init_scale=2.0 ** 12, growth_interval=2, group=False)
    bad_step, bad_rank = case.get("overflow", (None, None))
    problems = []
    for step, got in enumerate(answer["steps"][:steps]):
        mean = sum(got["grads"]) / t                # the shadow: every rank's gradient, averaged, unscaled, checked
        if case["scaler"]:
            mean = mean * (1.0 / shadow_scaler.loss_scale)
        found = case["scaler"] and not torch.isfinite(mean).all().item()
        if not found:
            shadow.grad = mean
            shadow_opt.step()
            fp32_opt.zero_grad()
            loss_of(ref, *batch(step), F32).backward()
            fp32_opt.step()
        if case["scaler"]:
            shadow_scaler.update(found)
        label = f"step {step}{' (overflow injected on group rank ' + str(bad_rank % t) + ')' if step == bad_step else ''}"
        if got["stepped"] is not (not found):
            problems.append(f"{label}: returned {got['stepped']}, expected {not found} (True when the optimizer "
                            "stepped)")
        if case["scaler"] and got["scale"] != shadow_scaler.loss_scale:
            problems.append(f"{label}: loss scale {got['scale']:g} afterwards, expected {shadow_scaler.loss_scale:g} "
                            f"(call scaler.update(found_inf) once per step)")
        where = f" [{start}:{end}]" if sharded else ""
        problems.append(err(f"{label}: master weights{where}", got["master"], shadow.detach()[start:end]))
        if not torch.equal(got["model"][start:end], got["master"].to(dtype).float()):
            problems.append(f"{label}: the model's {case['dtype']} weights{where} are not your master weights cast to "
                            f"{case['dtype']} (copy them back after the step)")
        if sharded:
            problems.append(err(f"{label}: the model's weights outside your shard (all-gathered)", got["model"],
                                shadow.detach().to(dtype).float(), 2 * torch.finfo(dtype).eps))
        if got["grads_left"]:
            problems.append(f"{label}: gradients left after the step (set the model's and the masters' .grad to None)")
        problems += _bytes(label, got["before"], got["after"], psi, end - start, masters, case)
        if any(problems):
            return problems
    if partial:
        return problems
    if len(answer["steps"]) != steps:
        return [f"the rank ran {len(answer['steps'])} of the case's {steps} steps"]
    if case.get("vs_fp32"):
        problems.append(err(f"after {steps} steps: master weights vs fp32 training in one process",
                            answer["steps"][-1]["master"], flat(ref.parameters())[start:end], VS_FP32[dtype]))
    return problems


def _bytes(label, before, after, psi, shard, tensors, case) -> list:
    if case["opt"] != "adam":
        return []
    want = expected_bytes(psi, shard, tensors, case["dtype"])
    out = []
    if before is not None and {k: before.get(k) for k in want} != want:
        out.append(f"{label}: before the step the rank held {before} bytes, expected {want} "
                   f"(2 + 2 + 12{'/N' if shard < psi else ''} per parameter)")
    want_after = dict(want, grads=0)
    if {k: after.get(k) for k in want_after} != want_after:
        out.append(f"{label}: after the step the rank held {after} bytes, expected {want_after} "
                   f"(gradients freed: 2 + 12{'/N' if shard < psi else ''} per parameter)")
    return out


def _bad_step_answer(fn, r, t, group, sharded: bool):
    """Masters that do not fit the model (one element too many, or one tensor missing)."""
    dev, dtype = rank_device(), LOW["bf16"]
    ref, low = make_models(dtype, dev)
    psi = sum(p.numel() for p in low.parameters())
    if sharded:
        s, e = shard_bounds(psi, r, t)
        master = torch.zeros(e - s + 1, device=dev, requires_grad=True)
        opt = torch.optim.SGD([master], lr=SGD_LR)
    else:
        master = [p.detach().clone().to(dev).requires_grad_() for p in ref.parameters()][:-1]
        opt = torch.optim.SGD(master, lr=SGD_LR)
    loss_of(low, *batch(0, dev), dtype).backward()
    return attempt(fn, (low, master, opt, None, group))


CASE_RUNNERS = {
    "DynamicLossScaler": RankRunner(scaler_answer, scaler_verdict),
    "mixed_precision_step": RankRunner(lambda fn, case, r, t, g: step_answer(fn, case, r, t, g, False),
                                       lambda case, r, t, answer: step_verdict(case, r, t, answer, False)),
    "zero1_mixed_precision_step": RankRunner(lambda fn, case, r, t, g: step_answer(fn, case, r, t, g, True),
                                             lambda case, r, t, answer: step_verdict(case, r, t, answer, True)),
}
