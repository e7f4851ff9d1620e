"""Lab 8's checks (memory beyond sharding: mixed precision with a dynamic loss scale, ZeRO-1 in
mixed precision, activation recomputation): each graded function against an fp32 reference.

Micikevicius et al. 2018 (mixed precision training, loss scaling); Rajbhandari et al. 2019 (ZeRO:
2 + 2 + 12 bytes per parameter with Adam, 2 + 2 + 12/N with ZeRO-1); Chen et al. 2016 and
Korthikanti et al. 2022 (full and selective recomputation). A lab test cell is a one-liner::

    checks.check_function("zero1_mixed_precision_step", zero1_mixed_precision_step)
    checks.check_function("zero1_mixed_precision_step", zero1_mixed_precision_step, hidden=True)

The distributed functions run in one launch of 4 ranks per call, cut into data-parallel groups of
t consecutive ranks (visible t = 2, 4; hidden 1–4; t = 3 runs next to a group of one). The steps
train a 43-parameter MLP (uneven shards over 2, 3 and 4 ranks) for two or three steps: the
master weights must equal an fp32 shadow fed with every rank's actual gradients (``TOL``), the
model's weights must be the masters cast back, the loss scale must follow the reference, the
gradients must be freed, and with Adam the model-state bytes each rank holds
(:func:`minidist.memory.model_state_bytes`) must be 2 + 2 + 12 (or 12/N) per parameter before the
step and 2 + 12 after it. Hidden: an overflow injected in one rank's gradient only (every rank
skips, the scale backs off, the next step recovers), bf16 without a scaler, mixed precision
against fp32 training in one process within ``lab8_cases.VS_FP32``, masters that do not fit
(``ValueError`` before any collective). ``recompute_blocks`` has no communication and is checked
in this process: output, input and parameter gradients equal the blocks run plainly with the same
random state, the random state afterwards is the same too, the caller's input and weights are
untouched, and the bytes saved for backward (:class:`minidist.memory.ActivationMeter`) equal the
formula of ``lab8_cases.block_activation_bytes`` to the byte. minidist's own implementation
(``minidist.memory_techniques``) is refused while a graded function runs. Every verdict is
given again by the grader's judge: the cases here by :mod:`minidist.checks.lab8_here`, those on
ranks by :mod:`minidist.checks.lab8_ranks`.
"""
from __future__ import annotations

import torch

from minidist.checks.kit.launch import check_timeout, launch_named, mark_case, one_thread, report_passed
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, judged
from minidist.checks.lab8_here import (SCALER, recompute_answer, recompute_cases, recompute_verdict, scaler_answer,
                                       scaler_cases, scaler_verdict)
from minidist.checks.kit.groups import consecutive_groups, judged_on_ranks, raise_first_group_problem, run_cases_in_groups
from minidist.checks.lab8_cases import TOL, VS_FP32, WORLD, ReferenceScaler, expected_saved, shard_bounds
from minidist.checks.lab8_ranks import CASE_RUNNERS
from minidist.checks.kit.quiet import passes_quietly
from minidist import cost
from minidist.memory import ActivationMeter, model_state, model_state_bytes
from minidist.models import TinyGPT, gpt_batch, gpt_loss
from minidist.runtime import import_optimizers_before_fork

import_optimizers_before_fork()      # the ranks build optimizers: they inherit the import

MEM_CHECK_TIMEOUT = check_timeout(20.0)
GRADED = ("DynamicLossScaler", "mixed_precision_step", "zero1_mixed_precision_step", "recompute_blocks")

#: minidist.memory_techniques is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("mixed precision, loss scaling and recomputation", ("minidist.memory_techniques",),
                  checks=__name__)

__all__ = ["GRADED", "REFUSED", "TOL", "VS_FP32", "ReferenceScaler", "check_function", "measure_bytes",
           "measure_recompute", "shard_bounds"]


def _body(progress, fn, name, cases):
    return run_cases_in_groups(progress, CASE_RUNNERS[name], fn, cases, WORLD)


def _cases(name: str, hidden: bool) -> list[dict]:
    ts = (1, 2, 3, 4) if hidden else (2, 4)
    if name == "DynamicLossScaler":
        cases = [dict(t=t, dtype=torch.float32, **v) for t in ts for v in ({}, {"bad_rank": 0})]
        if hidden:
            cases += [dict(t=t, dtype=torch.float32, bad_rank=t - 1, bad=float("nan"), no_grad=1) for t in ts]
            cases += [dict(t=t, dtype=torch.float16, bad_rank=1, bad=float("-inf")) for t in (2, 3)]
            cases += [dict(t=t, dtype=torch.float32, scale=1000.0) for t in (1, 4)]
        return cases
    if name in ("mixed_precision_step", "zero1_mixed_precision_step"):
        cases = [dict(t=t, dtype="fp16", scaler=True, opt="sgd") for t in ts if not hidden]
        cases += [dict(t=t, dtype="bf16", scaler=False, opt="adam") for t in ts if not hidden]
        if hidden:
            cases += [dict(t=t, dtype="fp16", scaler=True, opt="adam", steps=3, overflow=(1, t - 1), vs_fp32=True)
                      for t in ts]
            cases += [dict(t=t, dtype="bf16", scaler=False, opt="sgd", steps=3, vs_fp32=True) for t in (1, 3)]
            cases += [dict(t=t, raises=True) for t in (2, 3)]
        return cases
    raise ValueError(f"lab 8 has no graded function {name!r}; graded: {', '.join(GRADED)}")


COVERED = {
    "DynamicLossScaler": ("scale, update's history, unscale_ in place on t=2,4 with an inf on one rank",
                          "t=1..4, NaN/-inf on one rank, fp16 grads, a missing grad, scale 1000, bad arguments"),
    "mixed_precision_step": ("t=2,4: fp16+scaler+SGD, bf16+Adam vs the fp32 shadow; bytes 2+2+12 / 2+12",
                             "t=1..4: overflow on one rank skipped everywhere, 3 steps, vs fp32 training, ValueError"),
    "zero1_mixed_precision_step": ("t=2,4, uneven shards: fp16+scaler+SGD, bf16+Adam; bytes 2+2+12/N / 2+12/N",
                                   "t=1..4: overflow on one rank's shard skipped everywhere, vs fp32 training, "
                                   "ValueError"),
    "recompute_blocks": ("full, selective with dropout: output, grads, RNG, saved bytes = formula",
                         "none, no dropout, 3 layers, bad policy (ValueError)"),
}


# ----------------------------------------------------------------------------- in this process, judged
HERE = {SCALER: (scaler_cases, scaler_answer, scaler_verdict),
        "recompute_blocks": (recompute_cases, recompute_answer, recompute_verdict)}
JUDGED_HERE = Judged.of_functions(__name__, "check_function",
                                  {name: (cases, verdict) for name, (cases, _, verdict) in HERE.items()})
#: the cases on ranks, per (case, rank): the scaler's unscale_ and the steps
JUDGED_RANKS = Judged.of_functions(__name__, "check_function on ranks", {
    name: judged_on_ranks(name, lambda hidden, name=name: _cases(name, hidden), runner, WORLD)
    for name, runner in CASE_RUNNERS.items()})


@judged(JUDGED_HERE, JUDGED_RANKS)
@passes_quietly
def check_function(name: str, fn, hidden: bool = False, timeout: float = MEM_CHECK_TIMEOUT) -> None:
    """Lab 8's graded function ``name``: the steps and the scaler's unscale_ on 4 ranks cut into
    groups of t (visible t = 2, 4; hidden 1–4) against fp32 references, bytes per rank against
    2 + 2 + 12/N; the scaler's bookkeeping and recompute_blocks in this process."""
    if name in HERE:
        call = lambda *a, **k: graded_call(REFUSED, name, *a, **k)       # noqa: E731
        JUDGED_HERE.run(dict(name=name, hidden=hidden), lambda case: HERE[name][1](fn, case, call))
    if name != "recompute_blocks":
        cases = _cases(name, hidden)
        out = launch_named(_body, WORLD, fn, name, cases, name=name, timeout=timeout, refuse=REFUSED)
        raise_first_group_problem(name, cases, out, WORLD, JUDGED_RANKS, dict(name=name, hidden=hidden))
    report_passed(name, COVERED[name][hidden], hidden)


# ----------------------------------------------------------------------------- measurements (demo cells)
def _measure_body(progress, mixed_step, zero1_step, ts):
    import copy

    from minidist.runtime import device
    groups = consecutive_groups(ts, WORLD)
    rows = []
    for t, kind in [(1, "mixed")] + [(t, "zero1") for t in ts]:
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
                  timeout: float = MEM_CHECK_TIMEOUT) -> list[dict]:
    """Model-state bytes per parameter that rank 0 holds before and after the second bf16 Adam step of a
    TinyGPT (Ψ ≈ 30k) with your steps: section 3's at N = 1, ZeRO-1 at each N in ``ts``; next to
    :func:`minidist.cost.mixed_precision_bytes_per_param` (2 + 2 + 12/N, and 2 less after the step)."""
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
            x0 = torch.randn(b, s, d_model, generator=torch.Generator().manual_seed(0), device="cpu")
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
