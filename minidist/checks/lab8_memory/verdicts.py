"""Lab 8's verdicts: each answer against references rebuilt from its case alone (torch and
minidist's cost model; no student code runs here, so the grader's judge gives them again).

* the scaler: the reference's loss scale after each update, ``scale(loss)`` and its gradient,
  ``ValueError`` for bad arguments; ``unscale_``: every gradient divided in place, one all-reduce,
  the same found_inf on every rank of the group;
* a step: the fp32 *shadow* of the step replayed from the gradients every rank held before it (the
  answer records them, the check's own all-gather), so the student's master weights must equal it
  up to fp32 summation order; the 16-bit weights are the masters cast; the bytes a rank holds before
  and after (:func:`minidist.cost.mixed_precision_memory_bytes`); and, hidden, fp32 training of the
  same model in one process within ``VS_FP32``;
* ``recompute_blocks``: the plain blocks from the same random state (output, gradients, random
  state after), the caller's tensors unchanged, the bytes saved for backward equal to
  :func:`minidist.cost.activation_bytes` to the byte.
"""
from __future__ import annotations

import torch

from minidist import cost
from minidist.checks.kit.compare import TOLERANCE, counted, first, show, tensor_error, unchanged
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.raises import raise_verdict
from minidist.checks.kit.returned import returned_problem
from minidist.checks.kit.launch import one_thread
from minidist.checks.lab8_memory.cases import (F32, FLAGS, LOW, RB, SCALER, VS_FP32, WORLD, ReferenceScaler, batch,
                                               blocks_and_input, flat, loss_of, make_models, make_optimizer,
                                               run_blocks, scaler_grads, shard_bounds)


def scale_history(flags, **kw) -> list[float]:
    """The loss scale after each ``update(flag)`` of the reference."""
    s = ReferenceScaler(group=False, **kw)
    out = []
    for f in flags:
        s.update(f)
        out.append(s.loss_scale)
    return out


# ----------------------------------------------------------------------------- the scaler, in this process
def scaler(case, answer) -> str | None:
    kind, kw = case
    if kind == "start":
        return returned_problem(answer["scale"]) or (None if answer["scale"]["returned"] == 2.0 ** 16 else (
            f"{SCALER}(): loss_scale must start at init_scale = 2**16 = 65536.0, it is {answer['scale']['returned']!r}"))
    if kind == "scale":
        scaled, grad = answer["scaled"], answer.get("grad")
        if not isinstance(scaled, torch.Tensor):
            return (f"{SCALER}.scale(loss) must return a tensor that backward can go through (loss * loss_scale), "
                    f"got {scaled}")
        if scaled.item() != 6.0 * 2 ** 16 or not isinstance(grad, torch.Tensor) or grad.item() != 2.0 * 2 ** 16:
            shown = f"{grad.item():g}" if isinstance(grad, torch.Tensor) else "none"
            return (f"{SCALER}.scale(loss) must be loss · loss_scale: got {scaled.item():g} and a gradient of "
                    f"{shown} for loss = 6, d loss/dw = 2, scale 65536")
        return None
    call = f"{SCALER}({', '.join(f'{k}={v}' for k, v in kw.items())})"
    if kind == "bad":
        return None if answer.get("raised") == "ValueError" else f"{call} must raise ValueError"
    if foreign := first(returned_problem(s) for s in answer["scales"]):
        return foreign
    got, want = [s["returned"] for s in answer["scales"]], scale_history(FLAGS, **kw)
    if got != want:
        return (f"{call}: after update() with found_inf = {[int(f) for f in FLAGS]} the scale went {got}, "
                f"expected {want}")
    return None


# ----------------------------------------------------------------------------- unscale_, on ranks
def unscale(item, answer) -> str | None:
    """unscale_: every gradient divided by the scale in place, found_inf the same on every rank
    (an inf or NaN on one rank only), one all-reduce."""
    case, rank, r, t = item.case, item.rank, item.r, item.t
    dtype, scale, bad_rank = case["dtype"], case.get("scale", 2.0 ** 10), case.get("bad_rank")
    elsewhere = bad_rank is not None and case.get("bad_group") not in (None, rank // t)
    problems, expect = [], bad_rank is not None and not elsewhere
    if answer["found"] is None or answer["found"] != expect:
        where = f"group rank {bad_rank % t} only" if expect else "no rank of this group"
        problems.append(f"unscale_ returned {answer['shown']}, expected {expect} (a non-finite gradient on {where}): "
                        + ("every rank must agree" if not elsewhere else
                           "the overflow was in another group only, and ranks agree within their own group: "
                           "was the flag all-reduced over the whole world (group= left out)?"))
    ops = counted(answer["traffic"])
    if t > 1 and sum(n for (kind, _), n in ops.items() if kind == "all-reduce") != 1 or sum(ops.values()) > 1:
        problems.append(f"unscale_ must agree with exactly one all-reduce (of a flag), it called {show(ops)}")
    for i, (want, got, in_place) in enumerate(zip(scaler_grads(case, r, t)[0], answer["grads"], answer["in_place"])):
        if want is None:
            problems.append(None if got is None else f"param {i} had no gradient and now has one")
        elif got is None or not in_place:
            problems.append(f"param {i}'s gradient must be unscaled in place (the same tensor, divided by the scale)")
        elif not expect or i != 0:
            tol = None if dtype == F32 else torch.finfo(dtype).eps
            problems.append(tensor_error(f"param {i}'s unscaled gradient", got, want.double() / scale, dtype=dtype,
                                         tol=tol))
    return first(problems)


# ----------------------------------------------------------------------------- the two steps, on ranks
def step(item, answer) -> str | None:
    """``mixed_precision_step``'s steps against the fp32 shadow."""
    return first(_steps(item, answer, sharded=False))


def zero1_step(item, answer) -> str | None:
    """``zero1_mixed_precision_step``'s steps against the fp32 shadow, this rank's shard of it."""
    return first(_steps(item, answer, sharded=True))


def progress(item, answer, sharded: bool) -> str | None:
    """The first problem of the steps recorded so far (a rank asks after each step, ``answers.step``)."""
    return first(_steps(item, answer, sharded, partial=True))


def _steps(item, answer, sharded: bool, partial: bool = False) -> list:
    """The steps the answer recorded against the shadow, in order (the first that fails ends the
    list); ``partial``: the steps recorded so far."""
    case, r, t = item.case, item.r, item.t
    if case.get("raises"):
        return [raise_verdict(answer, "the master weights do not fit the model")]
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
    for i, got in enumerate(answer["steps"][:steps]):
        mean = sum(got["grads"]) / t                # the shadow: every rank's gradient, averaged, unscaled, checked
        if case["scaler"]:
            mean = mean * (1.0 / shadow_scaler.loss_scale)
        found = case["scaler"] and not torch.isfinite(mean).all().item()
        before = shadow.detach()[start:end].clone()
        if not found:
            shadow.grad = mean
            shadow_opt.step()
            fp32_opt.zero_grad()
            loss_of(ref, *batch(i), F32).backward()
            fp32_opt.step()
        if case["scaler"]:
            shadow_scaler.update(found)
        label = f"step {i}{' (overflow injected on group rank ' + str(bad_rank % t) + ')' if i == bad_step else ''}"
        if got["stepped"] is not (not found):
            problems.append(f"{label}: returned {got['stepped']}, expected {not found} (True when the optimizer "
                            "stepped)")
        if case["scaler"] and got["scale"] != shadow_scaler.loss_scale:
            problems.append(f"{label}: loss scale {got['scale']:g} afterwards, expected {shadow_scaler.loss_scale:g} "
                            f"(call scaler.update(found_inf) once per step)")
        where = f" [{start}:{end}]" if sharded else ""
        problems.append(_master_weights(f"{label}: master weights{where}", got["master"], shadow.detach()[start:end],
                                        before, t))
        if not torch.equal(got["model"][start:end], got["master"].to(dtype).float()):
            problems.append(f"{label}: the model's {case['dtype']} weights{where} are not your master weights cast to "
                            f"{case['dtype']} (copy them back after the step)")
        if sharded:
            problems.append(tensor_error(f"{label}: the model's weights outside your shard (all-gathered)",
                                         got["model"], shadow.detach().to(dtype).float(), tol=2 * torch.finfo(dtype).eps))
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
        problems.append(tensor_error(f"after {steps} steps: master weights", answer["steps"][-1]["master"],
                                     flat(ref.parameters())[start:end], tol=VS_FP32[dtype],
                                     against="fp32 training in one process"))
    return problems


def _master_weights(what, got, want, before, t) -> str | None:
    """The master weights against the shadow's; when they differ, the step they took (after - before)
    is diagnosed too: a gradient averaged over the wrong ranks shows there as a constant factor,
    hidden in the weights themselves by the much larger weights before the step."""
    problem = tensor_error(what, got, want)
    if problem is None or not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return problem
    sizes = {"t, the group's size": t, "N, the world's size": WORLD, "N/t": WORLD / t}
    step = tensor_error("the step they took (after - before)", got.double() - before.double(), want.double() - before.double(),
                        tol=TOLERANCE[want.dtype], factors=sizes)
    return f"{problem}\n  {step}" if step else problem


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
    if before is not None and {k: before.get(k) for k in want} != want:
        out.append(f"{label}: before the step the rank held {before} bytes, expected {want} "
                   f"(2 + 2 + 12{'/N' if shard < psi else ''} per parameter)")
    want_after = dict(want, grads=0)
    if {k: after.get(k) for k in want_after} != want_after:
        out.append(f"{label}: after the step the rank held {after} bytes, expected {want_after} "
                   f"(gradients freed: 2 + 12{'/N' if shard < psi else ''} per parameter)")
    return out


# ----------------------------------------------------------------------------- recomputation, in this process
def expected_saved(policy: str, layers: int, b, s, d, heads, d_ff, dropout: bool, elem: int = 4) -> int:
    """Bytes a stack of GPT blocks saves for backward under ``policy``, by
    :func:`minidist.cost.activation_bytes` (Korthikanti et al. 2022's count for these blocks as they
    run; on the CPU a dropout mask is a tensor of the activations' dtype, ``elem`` bytes an element)."""
    per_layer = cost.activation_bytes(policy, s, b, d, heads, dropout=dropout, elem_bytes=elem, mask_bytes=elem,
                                      stat_bytes=4, d_ff=d_ff)
    return int(layers * per_layer)


def _plain_blocks(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def recompute(case, answer) -> str | None:
    label = f"recompute_blocks ({describe_case(case)})"
    if case.get("raises"):
        return None if answer.get("raised") == "ValueError" else (
            f"{label}: policy {case['policy']!r} must raise ValueError (use 'none', 'full' or 'selective')")
    cfg, model, x0 = blocks_and_input(case)
    blocks = model.blocks
    weights = [p.detach().clone() for p in blocks.parameters()]
    x = x0.clone().requires_grad_()
    with one_thread():
        y_ref, _, rng_ref = run_blocks(_plain_blocks, blocks, x, 11)
    names = [n for n, _ in blocks.named_parameters()]
    grads = answer["grads"] if len(answer["grads"]) == len(names) else [None] * len(names)
    problems = [tensor_error("output", answer["y"], y_ref), tensor_error("x.grad", answer["x_grad"], x.grad) if
                answer["x_grad"] is not None else "x got no gradient"]
    problems += [tensor_error(f"gradient of {n}", g, p.grad) if g is not None else f"{n} got no gradient"
                 for n, g, p in zip(names, grads, blocks.parameters())]
    if not problems[0] and problems[1] and "likely cause" not in problems[1] and case["dropout"] > 0:
        problems[1] += ("; likely cause: the output is right and the gradients are not, with dropout on: the "
                        "recomputed forward drew other dropout masks than the first (save the random state "
                        "before the first forward and replay it for the recomputation)")
    problems.append(unchanged("input x", answer["x"], x0))
    digests = answer["weights"] if len(answer["weights"]) == len(names) else [None] * len(names)
    problems += [unchanged(f"weight {n}", d, w) for n, d, w in zip(names, digests, weights)]
    if not torch.equal(answer["rng"], rng_ref):
        problems.append("the random state after forward and backward is not what the plain run leaves "
                        "(replay dropout's random state for the recomputation, then put the generator back)")
    want = expected_saved(case["policy"], cfg["n_layers"], RB, cfg["seq_len"], cfg["d_model"], cfg["n_heads"],
                          4 * cfg["d_model"], case["dropout"] > 0)
    if answer["saved"] != want:
        problems.append(f"forward saved {answer['saved']} bytes for backward, the formula for {case['policy']!r} "
                        f"says {want} (ActivationMeter: what autograd's saved-tensor hooks see)")
    problem = next((p for p in problems if p), None)
    return f"{label}: {problem}" if problem else None
