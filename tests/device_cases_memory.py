"""Device-discipline cases of the memory techniques (see tests/device_discipline.py): the loss scaler,
mixed precision, ZeRO in mixed precision, recomputation, offload.

Each body runs inside a rank of a 2-rank launch whose default device is ``meta``; the models and
inputs are made on ``minidist.device()``. Every body checks its result: the 16-bit steps against
an fp32 Adam step of the same gradients done here with plain torch, the ZeRO variants against
each other and against the non-sharded step, recomputation against no recomputation (bit for
bit), the scaler against the flags every rank can predict.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import minidist
from device_discipline import Case, assert_real
from minidist import memory_techniques as MT
from minidist.models import GPTConfig, TinyGPT, gpt_batch, gpt_loss, local_slice

CFG = dict(vocab=12, d_model=8, n_heads=2, n_layers=1, seq_len=4)
LR = 1e-2


def _dev():
    return minidist.device()


def _on_device(*tensors):
    for t in tensors:
        assert_real(t)
        assert t.device == _dev(), f"a tensor is on {t.device}, expected {_dev()}"


def _model(dtype=torch.bfloat16):
    return MT.to_low_precision(TinyGPT(**CFG), dtype)


def _backward(model, step=0, forward=None, scale=1.0, shard=True):
    rank, n = (dist.get_rank(), dist.get_world_size()) if shard else (0, 1)
    ids, tgt = (local_slice(t, rank, n) for t in gpt_batch(step, 4, CFG["seq_len"], CFG["vocab"]))
    (gpt_loss((forward or model)(ids), tgt) * scale).backward()


def _adam_reference(model):
    """fp32 masters and one plain Adam step of the model's current 16-bit gradients."""
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    torch.optim.Adam(masters, lr=LR).step()
    return masters


def _loss_scaler():
    s = MT.DynamicLossScaler(4.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(3, device=_dev()))
    p.grad = torch.full((3,), 8.0, device=_dev())
    if dist.get_rank() == 1:
        p.grad[1] = float("inf")
    loss = s.scale(torch.ones((), device=_dev()))
    _on_device(loss)
    assert loss.item() == 4.0
    assert s.unscale_([p]) is True           # rank 1's inf, agreed by both
    _on_device(p.grad)
    s.update(True)
    assert s.get_scale() == 2.0 and s.found_inf([]) is False


def _mixed_precision_step():
    model = _model()
    masters = MT.make_master_params(model)
    _on_device(*masters)
    opt = torch.optim.Adam(masters, lr=LR)
    _backward(model, shard=False)
    want = _adam_reference(model)
    held = MT.state_bytes(model.parameters(), masters, opt)
    assert held["grads"] == held["params"]
    assert MT.mixed_precision_step(model, masters, opt)
    for m, w, p in zip(masters, want, model.parameters()):
        _on_device(m, p)
        torch.testing.assert_close(m.detach(), w.detach())
        assert torch.equal(p.detach(), m.detach().to(p.dtype))


def _master_step():
    model = _model(torch.float16)
    params = list(model.parameters())
    masters = MT.make_master_params(params)
    opt = torch.optim.Adam(masters, lr=LR)
    _backward(model, shard=False, scale=8.0)
    want = [p.detach().float().clone() for p in params]
    scaler = MT.DynamicLossScaler(8.0)
    if dist.get_rank() == 0:
        params[0].grad.fill_(float("inf"))
    assert not MT.master_step(params, masters, opt, scaler)            # skipped on both ranks: nothing moves
    for p, w in zip(params, want):
        _on_device(p)
        assert torch.equal(p.detach().float(), w)


def _optimizer():
    model = _model()
    opt = MT.MixedPrecisionOptimizer(model.parameters(), lr=LR)
    _backward(model, shard=False)
    want = _adam_reference(model)
    assert opt.step()
    for m, w in zip(opt.masters, want):
        _on_device(m)
        torch.testing.assert_close(m.detach(), w.detach())
    _on_device(*opt.state_tensors())


def _zero_stage(stage):
    model = _model()
    zero = MT.ZeroMixedPrecision(model, stage, lr=LR)
    _backward(model, forward=zero)
    held = zero.state_bytes()
    assert zero.step() and held["total"] > 0
    return zero, model


def _zero():
    """Every stage gives the masters of stage 0 (DDP) bit for bit (2 ranks: one bf16 addition, a
    halving), and stage 0 those of one process on the whole batch up to Adam's first step of
    ~lr·sign(g) taken the other way where 16 bits flip a tiny gradient's sign (2·lr)."""
    full = _model()
    ref = MT.MixedPrecisionOptimizer(full.parameters(), lr=LR)
    _backward(full, shard=False)
    ref.step()
    ddp = _zero_stage(0)[0].full_masters()
    for got, want in zip(ddp, ref.masters):
        _on_device(got)
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=2 * LR + 1e-3)
    for stage in (1, 2, 3):
        for got, want in zip(_zero_stage(stage)[0].full_masters(), ddp):
            _on_device(got)
            assert torch.equal(got, want), f"stage {stage}"


def _zero1_functional():
    """The functional ZeRO-1 updates the weights exactly as ZeroMixedPrecision's stage 1."""
    _, want = _zero_stage(1)
    model = _model()
    master = MT.make_master_shard(model)
    _on_device(master)
    opt = torch.optim.Adam([master], lr=LR)
    _backward(model)
    assert MT.zero1_mixed_precision_step(model, master, opt)
    for p, q in zip(model.parameters(), want.parameters()):
        _on_device(p)
        assert torch.equal(p.detach(), q.detach())


def _offload():
    model = _model()
    opt = MT.OffloadOptimizer(model.parameters(), lr=LR)
    _backward(model, shard=False)
    want = _adam_reference(model)
    assert opt.step()
    for m, w, p in zip(opt.masters, want, model.parameters()):
        _on_device(p)
        torch.testing.assert_close(m.detach().to(_dev()), w.detach())
    assert sum(opt.traffic.values()) == 4 * sum(p.numel() for p in model.parameters())


def _runs(policy, rng_modules=False):
    cfg = GPTConfig(**CFG, dropout=0.2)
    base = TinyGPT(cfg)
    x0 = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(1), device="cpu").to(_dev())
    out = {}
    for p in ("none", policy):
        model = copy.deepcopy(base)
        x = x0.clone().requires_grad_()
        torch.manual_seed(3)
        if rng_modules:
            y = MT.recompute(model.blocks[0], x, rng_modules=[model.blocks[0]]) if p != "none" else model.blocks[0](x)
        elif p == "raw":
            y = MT.Recompute.apply(model.blocks[0], [], x)
        else:
            y = MT.recompute_blocks(model.blocks, x, p if p != "raw" else "none")
        y.pow(2).sum().backward()
        _on_device(y, x.grad)
        out[p] = (y.detach(), x.grad)
    for a, b in zip(out["none"], out[policy]):
        assert torch.equal(a, b), policy


CASES = {
    "minidist.memory_techniques.DynamicLossScaler": Case(2, _loss_scaler),
    "minidist.memory_techniques.to_low_precision": Case(2, _mixed_precision_step),
    "minidist.memory_techniques.make_master_params": Case(2, _mixed_precision_step),
    "minidist.memory_techniques.mixed_precision_step": Case(2, _mixed_precision_step),
    "minidist.memory_techniques.state_bytes": Case(2, _mixed_precision_step),
    "minidist.memory_techniques.master_step": Case(2, _master_step),
    "minidist.memory_techniques.MixedPrecisionOptimizer": Case(2, _optimizer),
    "minidist.memory_techniques.ZeroMixedPrecision": Case(2, _zero),
    "minidist.memory_techniques.make_master_shard": Case(2, _zero1_functional),
    "minidist.memory_techniques.zero1_mixed_precision_step": Case(2, _zero1_functional),
    "minidist.memory_techniques.OffloadOptimizer": Case(2, _offload),
    "minidist.memory_techniques.recompute_blocks": Case(2, lambda: (_runs("selective"), _runs("full"))),
    "minidist.memory_techniques.recompute": Case(2, lambda: _runs("full", rng_modules=True)),
    "minidist.memory_techniques.Recompute": Case(2, lambda: _runs("raw")),
}

EXEMPT = {
    "minidist.memory_techniques.LOW_PRECISION": "a constant: the two 16-bit dtypes",
    "minidist.memory_techniques.POLICIES": "a constant: the recomputation policy names",
}
