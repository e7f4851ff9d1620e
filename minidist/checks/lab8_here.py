"""Lab 8's checks that run in the checking process, judged: the loss scaler's bookkeeping and
``recompute_blocks`` (no communication in either).

Micikevicius et al. 2018 (dynamic loss scaling: start at 2^16, scale the loss, back off by 1/2 on
an overflow, grow by 2 after ``growth_interval`` clean steps); Chen et al. 2016 and Korthikanti et
al. 2022 (full and selective recomputation: the same output and gradients as the plain run, fewer
bytes saved for backward, :func:`minidist.cost.activation_bytes`).

Each case is answered by the graded code (``*_answer``: what it returned, as plain data) and
given its verdict by a function of the case and that answer alone (``*_verdict``), which makes
the reference itself: the checks of :mod:`minidist.checks.lab8_memory` do both here, and the
grader's judge (:mod:`minidist.checks.kit.docket`) gives the verdict again where no student code runs.
"""
from __future__ import annotations

import torch

from minidist.checks.kit.docket import outcome
from minidist.checks.kit.groups import describe_case
from minidist.checks.lab8_cases import err, expected_saved, scale_history
from minidist.checks.kit.returned import require_plain
from minidist.memory import ActivationMeter, model_state
from minidist.models import TinyGPT
from minidist.checks.kit.launch import one_thread

SCALER = "DynamicLossScaler"
FLAGS = [False] * 4 + [True] + [False] * 2 + [True, True] + [False] * 7     # growth twice in a row at the end


# ----------------------------------------------------------------------------- the scaler
def scaler_cases(hidden: bool) -> list[tuple]:
    settings = [dict(init_scale=8.0, growth_interval=3)]
    bad = []
    if hidden:
        settings += [dict(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=1),
                     dict(init_scale=1.0, growth_interval=2)]
        bad = [dict(init_scale=0.0), dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(growth_interval=0)]
    return [("start", {}), ("scale", {})] + [("history", kw) for kw in settings] + [("bad", kw) for kw in bad]


def scaler_answer(cls, case, call) -> dict:
    """``call(f, *args)``: ``f(*args)`` as a graded call. The loss scale is read as one too (a property
    runs the student's code)."""
    kind, kw = case

    def loss_scale(s):
        value = call(getattr, s, "loss_scale", None)
        require_plain(f"{SCALER}.loss_scale", value)
        return value
    if kind == "bad":
        return outcome(lambda: call(cls, **kw))
    s = call(cls, **kw)
    if kind == "start":
        return {"scale": loss_scale(s)}
    if kind == "history":
        scales = []
        for f in FLAGS:
            call(s.update, f)
            scales.append(loss_scale(s))
        return {"scales": scales}
    w = torch.tensor(3.0, device="cpu", requires_grad=True)
    scaled = call(s.scale, w * 2.0)
    require_plain(f"{SCALER}.scale(loss)", scaled)
    if not isinstance(scaled, torch.Tensor) or scaled.grad_fn is None:
        return {"scaled": type(scaled).__name__}
    scaled.backward()
    return {"scaled": scaled.detach(), "grad": w.grad}


def scaler_verdict(case, answer) -> str | None:
    kind, kw = case
    if kind == "start":
        return None if answer["scale"] == 2.0 ** 16 else (
            f"{SCALER}(): loss_scale must start at init_scale = 2**16 = 65536.0, it is {answer['scale']!r}")
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
    want = scale_history(FLAGS, **kw)
    if answer["scales"] != want:
        return (f"{call}: after update() with found_inf = {[int(f) for f in FLAGS]} the scale went "
                f"{answer['scales']}, expected {want}")
    return None


# ----------------------------------------------------------------------------- recomputation
RECOMPUTE_CFG = dict(n_layers=2, d_model=16, n_heads=2, seq_len=8, vocab=8, seed=3)
RB = 2


def recompute_cases(hidden: bool) -> list[dict]:
    cases = [dict(policy=p, dropout=0.1) for p in ("full", "selective")]
    if hidden:
        cases += [dict(policy=p, dropout=0.0) for p in ("none", "full", "selective")]
        cases += [dict(policy=p, dropout=0.1, n_layers=3) for p in ("full", "selective")]
        cases += [dict(policy="checkpoint", dropout=0.0, raises=True)]
    return cases


def _model_and_input(case):
    cfg = dict(RECOMPUTE_CFG, n_layers=case.get("n_layers", 2), dropout=case["dropout"])
    x0 = torch.randn(RB, cfg["seq_len"], cfg["d_model"], generator=torch.Generator().manual_seed(4), device="cpu")
    return cfg, TinyGPT(device="cpu", **cfg), x0


def _run_blocks(forward, blocks, x, seed, backward=None):
    """Forward (its saved bytes), then backward with a fixed upstream gradient, from random state ``seed``."""
    torch.manual_seed(seed)
    meter = ActivationMeter([t for b in blocks for t in model_state(b)])
    with meter.recording():
        y = forward(blocks, x)
    saved = meter.bytes
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), device="cpu")
    (backward or (lambda y, g: y.backward(g)))(y, upstream)
    return y.detach(), saved, torch.get_rng_state()


def _plain(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def recompute_answer(fn, case, call) -> dict:
    _, model, x0 = _model_and_input(case)
    blocks = model.blocks
    if case.get("raises"):
        return outcome(lambda: call(fn, blocks, x0.clone().requires_grad_(), case["policy"]))
    x = x0.clone().requires_grad_()
    with one_thread():
        y, saved, rng = _run_blocks(lambda b, x: call(fn, b, x, case["policy"]), blocks, x, 11,
                                    lambda y, g: call(y.backward, g))
    return {"y": y, "saved": saved, "rng": rng, "x": x.detach(), "x_grad": x.grad,
            "grads": [p.grad for p in blocks.parameters()], "weights": [p.detach() for p in blocks.parameters()]}


def recompute_verdict(case, answer) -> str | None:
    label = f"recompute_blocks ({describe_case(case)})"
    if case.get("raises"):
        return None if answer.get("raised") == "ValueError" else (
            f"{label}: policy {case['policy']!r} must raise ValueError (use 'none', 'full' or 'selective')")
    cfg, model, x0 = _model_and_input(case)
    blocks = model.blocks
    weights = [p.detach().clone() for p in blocks.parameters()]
    x = x0.clone().requires_grad_()
    with one_thread():
        y_ref, _, rng_ref = _run_blocks(_plain, blocks, x, 11)
    names = [n for n, _ in blocks.named_parameters()]
    grads = answer["grads"] if len(answer["grads"]) == len(names) else [None] * len(names)
    problems = [err("output", answer["y"], y_ref), err("x.grad", answer["x_grad"], x.grad) if
                answer["x_grad"] is not None else "x got no gradient"]
    problems += [err(f"gradient of {n}", g, p.grad) if g is not None else f"{n} got no gradient"
                 for n, g, p in zip(names, grads, blocks.parameters())]
    if not torch.equal(answer["x"], x0):
        problems.append("the caller's input x was changed")
    if len(answer["weights"]) != len(weights) or any(not torch.equal(a, w) for a, w in zip(answer["weights"], weights)):
        problems.append("the blocks' weights were changed")
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
