"""Mixed precision, ZeRO's 2 + 2 + 12 bytes, recomputation: measured against the formulas.

One 4-rank launch runs every distributed case (world sizes 1, 2, 4 as sub-groups of it):
the bytes per parameter each rank holds after backward, under ZeRO 0-3 in bf16 and fp16,
against :mod:`minidist.cost.memory_techniques` (the slack is Adam's per-tensor step counter,
4 bytes, and the < N elements of padding of each flat shard: < 0.5% here); the trained weights
against an fp32 single-process reference; fp16 with an overflow injected on one rank only
(every rank skips, then recovers); recomputation in the tensor-parallel GPT with and without
sequence parallelism (saved bytes = formula to the byte, results = no recomputation, bit for
bit). The single-process cases run in the test process.
"""
import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import minidist
from minidist import cost
from minidist.checks.kit.groups import consecutive_groups
from minidist.memory import ActivationMeter, model_state
from minidist.memory_techniques import (DynamicLossScaler, OffloadOptimizer, ZeroMixedPrecision, make_master_params,
                                        make_master_shard, mixed_precision_step, recompute_blocks, state_bytes,
                                        to_low_precision, zero1_mixed_precision_step)
from minidist.models import GPTConfig, TinyGPT, flat_parameters, gpt_batch, gpt_loss, local_slice
from minidist.runtime import import_optimizers_before_fork
from minidist.trace import trace

import_optimizers_before_fork()      # the ranks build optimizers: they inherit torch._dynamo's import

CFG = dict(vocab=37, d_model=16, n_heads=2, n_layers=2, seq_len=8)      # 7,349 parameters: no N divides it
BATCH, STEPS, LR = 8, 2, 1e-3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SLACK = 0.005          # Adam's step counters and shard padding, relative
# fp32 masters vs fp32 single-process Adam from the same (16-bit representable) weights, after
# STEPS steps: ||Δ|| / ||reference's update|| (16-bit forward and backward; Adam's first steps
# are ~lr·sign(g), so a tiny gradient whose sign 16 bits flip moves 2·lr the other way). Measured:
# bf16 0.06-0.12, fp16 0.06-0.07; one step skipped: 0.46; fp32 itself: 0.
TOL = {"bf16": 0.2, "fp16": 0.15}
# GQA: 2 kv heads, split on t = 2, replicated on t = 4
TP_CFG = GPTConfig(vocab=16, d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=8, dropout=0.1)


def _numel():
    return sum(p.numel() for p in TinyGPT(**CFG, device="cpu").parameters())


@functools.lru_cache(maxsize=None)
def reference(dtype: str, steps=STEPS):
    """fp32 single-process Adam on the full batch, from the weights rounded to ``dtype`` (where
    the masters start): (initial, final) flat weights."""
    model = TinyGPT(**CFG, device="cpu").to(DTYPES[dtype]).float()
    init = flat_parameters(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        ids, tgt = gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"], device="cpu")
        gpt_loss(model(ids), tgt).backward()
        opt.step()
        opt.zero_grad()
    return init, flat_parameters(model)


# ----------------------------------------------------------------------------- inside the ranks
def _train_zero(dtype, stage, group, rank, size):
    model = to_low_precision(TinyGPT(**CFG), DTYPES[dtype])
    scaler = DynamicLossScaler(2.0 ** 10, group=group) if dtype == "fp16" else None
    zero = ZeroMixedPrecision(model, stage, group=group, scaler=scaler, lr=LR)
    for step in range(STEPS):
        ids, tgt = (local_slice(t, rank, size) for t in gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"]))
        zero.scale(gpt_loss(zero(ids), tgt)).backward()
        if step == 1:
            held = zero.state_bytes()
        assert zero.step(), f"step {step} skipped"
        zero.zero_grad()
    return {"held": held, "masters": torch.cat([m.reshape(-1).cpu() for m in zero.full_masters()])}


def _train_zero1_functional(group, rank, size):
    model = to_low_precision(TinyGPT(**CFG), torch.bfloat16)
    master = make_master_shard(model, group)
    opt = torch.optim.Adam([master], lr=LR)
    for step in range(STEPS):
        ids, tgt = (local_slice(t, rank, size) for t in gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"]))
        gpt_loss(model(ids), tgt).backward()
        assert zero1_mixed_precision_step(model, master, opt, None, group)
    return {"weights": flat_parameters(model), "master": master.detach().cpu()}


def _poison(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def _overflow(stage, functional=False):
    """fp16 on 4 ranks; at step 1 rank 2's gradient of one weight element is inf (a hook, so it
    enters the reduction: the element's owner, not rank 2, is the one whose shard overflows)."""
    rank = dist.get_rank()
    model = to_low_precision(TinyGPT(**CFG), torch.float16)
    scaler = DynamicLossScaler(2.0 ** 10, growth_interval=2)
    if functional:
        masters = [make_master_shard(model)]
        opt = torch.optim.Adam(masters, lr=LR)
        forward, step_fn = model, lambda: zero1_mixed_precision_step(model, masters[0], opt, scaler)  # noqa: E731
    else:
        zero = ZeroMixedPrecision(model, stage, scaler=scaler, lr=LR)
        masters = zero.optimizer.masters
        forward, step_fn = zero, lambda: (zero.step(), zero.zero_grad())[0]             # noqa: E731
    taken, changed = [], []
    for step in range(4):
        ids, tgt = (local_slice(t, rank, 4) for t in gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"]))
        before = torch.cat([m.detach().reshape(-1) for m in masters])
        hook = model.lm_head.weight.register_hook(_poison) if (step, rank) == (1, 2) else None
        scaler.scale(gpt_loss(forward(ids), tgt)).backward()
        if hook is not None:
            hook.remove()
        taken.append(step_fn())
        changed.append(not torch.equal(before, torch.cat([m.detach().reshape(-1) for m in masters])))
    with trace() as t:
        scaler.unscale_([torch.nn.Parameter(torch.ones(3, device=minidist.device()))])
    return {"taken": taken, "changed": changed, "history": scaler.history, "ops": dict(t.op_counts())}


def _tp_recompute(group, t, sp):
    out = {}
    x0 = torch.randn(2, TP_CFG.seq_len // (t if sp else 1), TP_CFG.d_model,
                     generator=torch.Generator().manual_seed(3)).to(minidist.device())
    for policy in ("none", "selective", "full"):
        from minidist.tensor_parallel import tensor_parallel_gpt
        model = tensor_parallel_gpt(TinyGPT(TP_CFG), group, sequence_parallel=sp)
        x = x0.clone().requires_grad_()
        meter = ActivationMeter(model_state(model))
        with meter.recording():
            y = recompute_blocks(model.blocks, x, policy)
        saved = meter.bytes
        (y * y).sum().backward()
        out[policy] = {"saved": saved, "y": y.detach(), "dx": x.grad,
                       "grads": [p.grad.clone() for p in model.blocks.parameters()]}
    return out


def rank_cases():
    groups = consecutive_groups([1, 2, 4], 4)
    out = {"zero": {}, "tp": {}}
    for n, (group, rank, size) in groups.items():
        for dtype in DTYPES:
            for stage in (0, 1, 2, 3) if n == 4 else (1, 2, 3):
                out["zero"][(n, dtype, stage)] = _train_zero(dtype, stage, group, rank, size)
    out["zero1_functional"] = _train_zero1_functional(groups[4][0], groups[4][1], 4)
    out["overflow"] = {stage: _overflow(stage) for stage in (1, 2, 3)}
    out["overflow"]["functional"] = _overflow(1, functional=True)
    for t in (2, 4):
        for sp in (False, True):
            out["tp"][(t, sp)] = _tp_recompute(groups[t][0], t, sp)
    return out


@functools.lru_cache(maxsize=None)
def launched():
    return minidist.launch(rank_cases, 4, timeout=300)


def _relative_error(weights, ref, init):
    """||weights − ref|| / ||ref − init||: the error as a share of the reference's update."""
    return ((weights - ref).norm() / (ref - init).norm()).item()


# ----------------------------------------------------------------------------- ZeRO in mixed precision
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bytes_per_parameter_are_2_2_12_sharded_by_stage(dtype):
    numel = _numel()
    for rank, out in enumerate(launched()):
        for (n, dt, stage), r in out["zero"].items():
            if dt != dtype:
                continue
            want = cost.mixed_precision_memory_bytes(dtype, stage, numel, n)
            for k in ("params", "grads", "optimizer", "total"):
                assert r["held"][k] == pytest.approx(want[k], rel=SLACK), (rank, n, dtype, stage, k, r["held"])
            assert r["held"]["total"] / numel == pytest.approx(
                cost.mixed_precision_bytes_per_param(dtype, stage, n), rel=SLACK)
    # the headline numbers themselves
    assert [cost.mixed_precision_bytes_per_param("bf16", s, 4) for s in range(4)] == [16, 2 + 2 + 3, 2 + 3.5, 4]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mixed_precision_training_follows_the_fp32_reference(dtype):
    init, ref = reference(dtype)
    for rank, out in enumerate(launched()):
        for (n, dt, stage), r in out["zero"].items():
            if dt == dtype:
                err = _relative_error(r["masters"], ref, init)
                assert err < TOL[dtype], f"rank {rank} N={n} {dtype} stage {stage}: {err:.3g} of the update"
    if dtype == "bf16":         # the functional ZeRO-1: the same masters, the copy-back in its weights
        for rank, out in enumerate(launched()):
            f = out["zero1_functional"]
            shard = -(-init.numel() // 4)
            mine = ref[rank * shard:(rank + 1) * shard]
            assert _relative_error(f["master"][:mine.numel()], mine, init[rank * shard:(rank + 1) * shard]) < TOL[dtype]
            assert torch.equal(f["weights"][rank * shard:(rank + 1) * shard],
                               f["master"][:mine.numel()].to(torch.bfloat16).float()), f"rank {rank}: copy-back"


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_then_recovers():
    for rank, out in enumerate(launched()):
        for case, r in out["overflow"].items():
            assert r["taken"] == [True, False, True, True], (rank, case, r["taken"])
            assert r["changed"] == [True, False, True, True], (rank, case, r["changed"])
            scales = [s for s, _ in r["history"]]
            assert scales == [1024.0, 1024.0, 512.0, 512.0], (rank, case, scales)   # backoff, then 2 clean
            assert r["ops"] == {"all_reduce": 1}, (rank, case, r["ops"])             # one all-reduce decides


# ----------------------------------------------------------------------------- single process
def test_bf16_without_scaler_and_the_step_api():
    init, ref = reference("bf16")
    model = to_low_precision(TinyGPT(**CFG, device="cpu"), torch.bfloat16)
    masters = make_master_params(model)
    opt = torch.optim.Adam(masters, lr=LR)
    for step in range(STEPS):
        ids, tgt = gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"], device="cpu")
        gpt_loss(model(ids), tgt).backward()
        held = state_bytes(model.parameters(), masters, opt)
        assert mixed_precision_step(model, masters, opt)
        assert all(p.grad is None for p in model.parameters())
    numel = _numel()
    assert held["total"] == pytest.approx(16 * numel, rel=SLACK)
    assert (held["params"], held["grads"]) == (2 * numel, 2 * numel)
    assert _relative_error(torch.cat([m.detach().reshape(-1) for m in masters]), ref, init) < TOL["bf16"]
    # the copy-back: the bf16 weights are the masters rounded
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(p, m.detach().to(torch.bfloat16))


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(8.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([8.0, 16.0])
    assert not s.unscale_([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0]))
    for found in (False, False, False, True, False):
        s.update(found)
    assert [h for h, _ in s.history] == [8, 8, 8, 16, 8] and s.get_scale() == 8 and s.skipped == 1
    p.grad = torch.tensor([float("nan"), 1.0])
    assert s.unscale_([p])
    with pytest.raises(ValueError):
        DynamicLossScaler(backoff_factor=1.5)


def _run_policy(model, x0, policy):
    m = copy.deepcopy(model)
    x = x0.clone().requires_grad_()
    torch.manual_seed(7)
    meter = ActivationMeter(model_state(m))
    with meter.recording():
        y = recompute_blocks(m.blocks, x, policy)
    saved = meter.bytes
    with FlopCounterMode(display=False) as flops:
        (y * y).sum().backward()
    return {"saved": saved, "y": y.detach(), "dx": x.grad, "rng_after": torch.rand(3),
            "grads": [p.grad for p in m.parameters() if p.grad is not None], "backward_flops": flops.get_total_flops()}


def test_recompute_reference_gpt_saves_the_formula_and_changes_nothing():
    cfg = GPTConfig(vocab=16, d_model=16, n_heads=2, n_layers=2, seq_len=8, dropout=0.1)
    model = TinyGPT(cfg, device="cpu")
    x0 = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1))
    runs = {p: _run_policy(model, x0, p) for p in ("none", "selective", "full")}
    for policy, r in runs.items():
        # nn.Dropout keeps a float mask on the CPU: 4 bytes per element
        terms = cost.activation_terms(policy, cfg.seq_len, 2, cfg.d_model, cfg.n_heads, dropout=True, mask_bytes=4)
        assert r["saved"] == cfg.n_layers * sum(terms.values()), (policy, r["saved"], terms)
        for k in ("y", "dx", "rng_after"):
            assert torch.equal(r[k], runs["none"][k]), (policy, k)
        assert all(torch.equal(a, b) for a, b in zip(r["grads"], runs["none"]["grads"], strict=True)), policy
        extra = r["backward_flops"] - runs["none"]["backward_flops"]
        assert extra == cost.recompute_flops(policy, 2, cfg.seq_len, cfg.d_model, cfg.n_layers), (policy, extra)
    assert runs["full"]["saved"] < runs["selective"]["saved"] < runs["none"]["saved"]
    # an input that needs no gradient: the parameters still get theirs
    grads = {}
    for policy in ("none", "full"):
        m = copy.deepcopy(model)
        torch.manual_seed(7)
        recompute_blocks(m.blocks, x0, policy).pow(2).sum().backward()
        grads[policy] = [p.grad for p in m.parameters() if p.grad is not None]
    assert len(grads["full"]) == len(grads["none"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads["full"], grads["none"]))


def test_recompute_tensor_parallel_gpt_with_and_without_sequence_parallelism():
    cfg = TP_CFG
    for rank, out in enumerate(launched()):
        for (t, sp), runs in out["tp"].items():
            for policy, r in runs.items():
                formula = cfg.n_layers * cost.activation_bytes(policy, cfg.seq_len, 2, cfg.d_model, cfg.n_heads, t,
                                                               sequence_parallel=sp, dropout=True,
                                                               kv_heads=cfg.n_kv_heads)
                assert r["saved"] == formula, (rank, t, sp, policy, r["saved"], formula)
                for k in ("y", "dx"):
                    assert torch.equal(r[k], runs["none"][k]), (rank, t, sp, policy, k)
                assert all(torch.equal(a, b) for a, b in zip(r["grads"], runs["none"]["grads"], strict=True))


def test_offload_steps_on_the_host_and_moves_4_bytes_per_parameter():
    init, ref = reference("bf16")
    model = to_low_precision(TinyGPT(**CFG, device="cpu"), torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), host="cpu", lr=LR)
    numel = _numel()
    for step in range(STEPS):
        ids, tgt = gpt_batch(step, BATCH, CFG["seq_len"], CFG["vocab"], device="cpu")
        gpt_loss(model(ids), tgt).backward()
        on_device = opt.device_bytes()
        assert opt.step()
        assert opt.traffic == {"down": 2 * numel, "up": 2 * numel} == {
            k: v for k, v in cost.offload_traffic_bytes(numel).items() if k != "total"}
    assert on_device["total"] == cost.offload_memory_bytes(numel)["device"] == 4 * numel
    assert opt.host_bytes() == pytest.approx(cost.offload_memory_bytes(numel)["host"], rel=SLACK)
    assert _relative_error(torch.cat([m.detach().reshape(-1) for m in opt.masters]), ref, init) < TOL["bf16"]
    # fp16 with a scaler: an overflow moves nothing
    model = to_low_precision(TinyGPT(**CFG, device="cpu"), torch.float16)
    opt = OffloadOptimizer(model.parameters(), scaler=DynamicLossScaler(2.0 ** 10), lr=LR)
    ids, tgt = gpt_batch(0, BATCH, CFG["seq_len"], CFG["vocab"], device="cpu")
    (gpt_loss(model(ids), tgt) * float("inf")).backward()
    assert not opt.step() and opt.traffic == {"down": 0, "up": 0} and opt.scaler.get_scale() == 512


def test_formulas_agree_with_the_paper_and_the_planner_uses_them():
    from minidist.cost.pipeline import pipeline_peak_activations
    from minidist.cost.planner import ModelSpec, Plan, memory
    s, b, h, a = 2048, 4, 1024, 16
    for t in (1, 2, 4):
        for sp in (False, True):
            for policy in ("none", "selective", "full"):
                ours = cost.activation_bytes(policy, s, b, h, a, t, sequence_parallel=sp, dropout=True, elem_bytes=2,
                                             stat_bytes=0)
                assert ours == pytest.approx(cost.activation_bytes_paper(policy, s, b, h, a, t, sp), rel=1e-12)
    assert cost.activation_bytes_paper("selective", s, b, h, a) == 34 * s * b * h
    assert cost.recompute_flops("full", b, s, h) == cost.layer_forward_flops(b, s, h) == 24 * b * s * h * h + 4 * b * s * s * h
    assert cost.recompute_flops("selective", b, s, h, layers=3, t=2) == 3 * 4 * b * s * s * h / 2
    model = ModelSpec(6.74e9, 32, 4096, 32, 4096)
    plan = Plan(dp=4, pp=2, tp=2, cp=1, micro_batch=1, micro_batches=8)
    for policy in ("none", "selective", "full"):
        got = memory(model, plan, zero_stage=1, recompute=policy, sequence_parallel=True)
        per_layer = cost.activation_bytes_paper(policy, model.seq, 1, model.hidden, model.heads, 2, True)
        assert got["activations"] == per_layer * (model.layers // 2) * pipeline_peak_activations("1f1b", 2, 8, rank=0)
        assert got["optimizer"] == pytest.approx(12 * (got["params"] / 2) / 4)      # 2 bytes/param; 12/N, N = DP = 4
