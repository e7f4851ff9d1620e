"""Device-discipline cases for library B (see tests/device_discipline.py): tensor parallelism,
context parallelism, the 3D mesh, the GPT models and the 3D harness.

Every body runs inside a rank of a 4-rank launch (one launch runs them all), with its inputs
made on ``minidist.device()`` while torch's default device is ``meta``. Each runs forward and,
where there is one, backward, and compares the result with a reference computed in the same
rank from plain torch ops (or from the single-process GPT modules, themselves checked here
against plain ops first); ``close`` fails on a meta tensor, a tensor off the inputs' device,
a wrong shape or a wrong value. Rank-dependent data (upstream gradients, partial sums) is drawn
from seeds every rank knows, so each rank can form the sum over ranks it must receive.
Custom backwards run under the same discipline (``device_discipline.default_device_in_backward``).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minidist
from device_discipline import Case, assert_real
from minidist import context_parallel as cp
from minidist import mesh as mesh3d
from minidist import models
from minidist import tensor_parallel as tp
from minidist.harness import parallel3d as h3d

WORLD = 4
CFG = models.GPTConfig(vocab=20, d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=8)   # kv replicated on 4
B = 2


# ----------------------------------------------------------------------------- helpers
def dev() -> torch.device:
    return minidist.device()


def randn(*shape, seed: int = 0, dtype=torch.float32, grad: bool = False) -> torch.Tensor:
    """Drawn on the CPU from ``seed`` (the same numbers on every rank), placed on this rank's device."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype, device="cpu").to(dev())
    return x.requires_grad_() if grad else x


def close(got, want, tol: float = 1e-5, what: str = "result") -> None:
    """``got`` is real, on this rank's device, shaped like ``want`` and equal to it (relative above 1)."""
    assert_real(got, want)
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert got.device == want.device == dev(), f"{what} is on {got.device}, the inputs on {dev()}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got.detach().double() - want.detach().double()).abs().max().item() / max(1.0, want.abs().max().item())
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:g}"


def rank_t(group=None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def on_device(module: nn.Module) -> None:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        assert_real(t)
        assert t.device == dev(), f"{name} is on {t.device}, expected {dev()}"


def grads_close(ours: nn.Module, expected: nn.Module, tol: float = 1e-5) -> None:
    """Every gradient of ``ours`` equals the parameters of ``expected`` (a reference's
    gradients cut the way ``ours`` was cut, see tensor_parallel.grads_as_params)."""
    for (n, p), (m, q) in zip(ours.named_parameters(), expected.named_parameters(), strict=True):
        assert n == m and p.grad is not None, (n, m)
        close(p.grad, q.detach(), tol, f"gradient of {n}")


# single-process references from plain torch ops (SDPA, F.linear), not from the modules under test
def sdpa(q, k, v, causal):
    """(b, h, s, d) attention, GQA allowed."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def ref_attention(attn, x):
    b, s, _ = x.shape
    heads = lambda t: t.view(b, s, -1, attn.head_dim).transpose(1, 2)     # noqa: E731
    q, k, v = (heads(F.linear(x, m.weight, m.bias)) for m in (attn.q, attn.k, attn.v))
    return F.linear(sdpa(q, k, v, True).transpose(1, 2).reshape(b, s, -1), attn.o.weight, attn.o.bias)


def ref_mlp(mlp, x):
    return F.linear(F.gelu(F.linear(x, mlp.fc.weight, mlp.fc.bias)), mlp.proj.weight, mlp.proj.bias)


def ref_layer_norm(ln, x):
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def ref_block(block, x):
    x = x + ref_attention(block.attn, ref_layer_norm(block.ln_1, x))
    return x + ref_mlp(block.mlp, ref_layer_norm(block.ln_2, x))


def ref_gpt(model, ids):
    x = F.embedding(ids, model.tok_emb.weight) + model.pos_emb.weight[:ids.shape[1]]
    for block in model.blocks:
        x = ref_block(block, x)
    return F.linear(ref_layer_norm(model.ln_f, x), model.lm_head.weight)


def sum_over_ranks(make, t):
    """Σ_r make(r): what an all-reduce of rank-dependent ``make(rank)`` gives every rank."""
    return sum(make(r) for r in range(t))


def input_grad_matches(module, ref_fn, x_shape, tol=1e-5):
    """Forward and backward of ``module`` vs ``ref_fn`` on the same input and upstream gradient."""
    x = randn(*x_shape, seed=1, grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = module(x), ref_fn(x_ref)
    close(y, y_ref, tol, "output")
    w = randn(*y.shape, seed=2)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    close(x.grad, x_ref.grad, tol, "input gradient")


# ----------------------------------------------------------------------------- models (GPT)
def case_repeat_kv():
    x = randn(1, 2, 3, 4, grad=True)
    y = models.repeat_kv(x, 3)
    close(y, x.detach().repeat_interleave(3, dim=1))
    y.sum().backward()
    close(x.grad, torch.full_like(x, 3.0), what="gradient")


def case_causal_attention():
    s = 6
    q = randn(1, 4, s, 8, seed=1, grad=True)                   # GQA: 4 query heads read 2 kv heads
    k, v = randn(1, 2, s, 8, seed=2, grad=True), randn(1, 2, s, 8, seed=3, grad=True)
    future = torch.ones(s, s, dtype=torch.bool, device=dev()).triu(1)
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, ref = models.causal_attention(q, k, v, future), sdpa(*refs, True)
    close(out, ref)
    w = randn(*out.shape, seed=4)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in zip((q, k, v), refs):
        close(a.grad, b.grad, what="q/k/v gradient")


def case_causal_self_attention():
    torch.manual_seed(0)
    attn = models.CausalSelfAttention(CFG)
    on_device(attn)
    input_grad_matches(attn, lambda x: ref_attention(attn, x), (B, 6, CFG.d_model))


def case_gpt_mlp():
    torch.manual_seed(0)
    mlp = models.GPTMLP(CFG)
    on_device(mlp)
    input_grad_matches(mlp, lambda x: ref_mlp(mlp, x), (B, 6, CFG.d_model))


def case_gpt_block():
    torch.manual_seed(0)
    block = models.GPTBlock(CFG)
    on_device(block)
    input_grad_matches(block, lambda x: ref_block(block, x), (B, 6, CFG.d_model))


def case_tiny_gpt():
    model = models.TinyGPT(CFG)
    on_device(model)
    ids, targets = models.gpt_batch(0, B, CFG.seq_len, CFG.vocab)
    logits = model(ids)
    close(logits, ref_gpt(model, ids))
    models.gpt_loss(logits, targets).backward()
    expected = torch.autograd.grad(F.cross_entropy(ref_gpt(model, ids).flatten(0, 1), targets.flatten()),
                                   model.tok_emb.weight)[0]
    close(model.tok_emb.weight.grad, expected, what="token embedding gradient")


def case_gpt_loss():
    logits = randn(2, 5, 7, seed=1, grad=True)
    targets = torch.tensor([[1, 2, -100, 4, 0], [6, -100, 3, 3, 5]], device=dev())
    valid = targets != -100
    logp = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ref = -(logp * valid).sum() / valid.sum()
    loss = models.gpt_loss(logits, targets)
    close(loss, ref)
    (expected,) = torch.autograd.grad(ref, logits)
    loss.backward()
    close(logits.grad, expected, what="logits gradient")


def case_gpt_batch():
    ids, targets = models.gpt_batch(3, 4, 6, 11)
    assert_real(ids, targets)
    assert ids.device == targets.device == dev() and ids.dtype == torch.int64 and ids.shape == (4, 6)
    assert torch.equal(ids[:, 1:], targets[:, :-1]), "targets are not the ids shifted by one"
    assert int(ids.min()) >= 0 and int(targets.max()) < 11
    again, _ = models.gpt_batch(3, 4, 6, 11)
    assert torch.equal(ids, again), "the batch of a step is not deterministic"


# ----------------------------------------------------------------------------- tensor parallel: comm
def case_copy_to_tp():
    rank, t = rank_t()
    x = randn(3, 4, seed=1, grad=True)
    y = tp.copy_to_tp(x)
    close(y, x.detach())
    y.backward(randn(3, 4, seed=10 + rank))
    close(x.grad, sum_over_ranks(lambda r: randn(3, 4, seed=10 + r), t), what="gradient (all-reduced)")


def case_reduce_from_tp():
    rank, t = rank_t()
    x = randn(3, 4, seed=10 + rank, grad=True)
    y = tp.reduce_from_tp(x)
    close(y, sum_over_ranks(lambda r: randn(3, 4, seed=10 + r), t))
    g = randn(3, 4, seed=2)
    y.backward(g)
    close(x.grad, g, what="gradient (identity)")


def case_gather_along_dim():
    rank, t = rank_t()
    full = randn(2, 8, 3, seed=1)
    x = full.chunk(t, 1)[rank].clone().requires_grad_()
    y = tp.gather_along_dim(x, 1)
    close(y, full)
    y.backward(randn(2, 8, 3, seed=10 + rank))
    expected = sum_over_ranks(lambda r: randn(2, 8, 3, seed=10 + r), t).chunk(t, 1)[rank]
    close(x.grad, expected, what="gradient (reduce-scattered)")


def case_reduce_scatter_along_dim():
    rank, t = rank_t()
    x = randn(2, 8, 3, seed=10 + rank, grad=True)
    y = tp.reduce_scatter_along_dim(x, 1)
    close(y, sum_over_ranks(lambda r: randn(2, 8, 3, seed=10 + r), t).chunk(t, 1)[rank])
    y.backward(randn(2, 2, 3, seed=20 + rank))
    close(x.grad, torch.cat([randn(2, 2, 3, seed=20 + r) for r in range(t)], 1), what="gradient (all-gathered)")


def case_split_along_dim():
    rank, t = rank_t()
    x = randn(3, 8, seed=1, grad=True)
    y = tp.split_along_dim(x, -1)
    close(y, x.detach().chunk(t, -1)[rank])
    y.backward(randn(3, 2, seed=20 + rank))
    close(x.grad, torch.cat([randn(3, 2, seed=20 + r) for r in range(t)], -1), what="gradient (all-gathered)")


def case_gather_from_tp():
    rank, t = rank_t()
    full = randn(3, 8, seed=1)
    x = full.chunk(t, -1)[rank].clone().requires_grad_()
    y = tp.gather_from_tp(x, -1)
    close(y, full)
    g = randn(3, 8, seed=2)
    y.backward(g)
    close(x.grad, g.chunk(t, -1)[rank], what="gradient (my chunk)")


def case_new_tp_group():
    group = tp.new_tp_group(2)
    rank = dist.get_rank()
    assert dist.get_process_group_ranks(group) == [rank - rank % 2, rank - rank % 2 + 1]
    x = randn(3, seed=10 + rank)
    close(tp.reduce_from_tp(x, group), randn(3, seed=10 + rank - rank % 2) + randn(3, seed=11 + rank - rank % 2))


def case_tp_rank():
    group = tp.new_tp_group(2)
    assert tp.tp_rank(group) == dist.get_rank() % 2 and tp.tp_rank() == dist.get_rank()


def case_tp_size():
    assert tp.tp_size(tp.new_tp_group(2)) == 2 and tp.tp_size() == WORLD


# ----------------------------------------------------------------------------- tensor parallel: layers
def _linear(i, o, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(i, o, device=dev())


def _layer_vs_linear(ours, lin, x_shape, x_of=lambda x: x, out_of=lambda y: y, grad_of=lambda g: g,
                     expected=None, sync=False):
    """Forward/backward of a TP layer vs the full ``nn.Linear`` on the same data; this rank's
    part of input, output and input gradient cut by ``x_of``/``out_of``/``grad_of``."""
    full = randn(*x_shape, seed=1, grad=True)
    x = x_of(full.detach()).clone().requires_grad_()
    y, y_ref = ours(x), lin(full)
    close(y, out_of(y_ref), what="output")
    w = randn(*y_ref.shape, seed=2)
    (y * out_of(w)).sum().backward()
    (y_ref * w).sum().backward()
    if sync:
        tp.sync_sequence_parallel_grads(ours)
    close(x.grad, grad_of(full.grad), what="input gradient")
    if expected is not None:
        grads_close(ours, expected(tp.grads_as_params(lin)))


def case_column_parallel_linear():
    rank, t = rank_t()
    lin = _linear(6, 8)
    rows = slice(2 * rank, 2 * rank + 2)
    w, b = lin.weight.detach()[rows].clone().requires_grad_(), lin.bias.detach()[rows].clone().requires_grad_()
    full = randn(3, 6, seed=1, grad=True)
    x = full.detach().clone().requires_grad_()
    y = tp.column_parallel_linear(x, w, b, gather_output=True)
    y_ref = lin(full)
    close(y, y_ref)
    g = randn(3, 8, seed=2)
    y.backward(g)
    y_ref.backward(g)
    close(x.grad, full.grad, what="input gradient")
    close(w.grad, lin.weight.grad[rows], what="weight gradient")
    close(b.grad, lin.bias.grad[rows], what="bias gradient")


def case_row_parallel_linear():
    rank, t = rank_t()
    lin = _linear(8, 5)
    cols = slice(2 * rank, 2 * rank + 2)
    w, b = lin.weight.detach()[:, cols].clone().requires_grad_(), lin.bias.detach().clone().requires_grad_()
    full = randn(3, 8, seed=1, grad=True)
    x = full.detach()[:, cols].clone().requires_grad_()
    y, y_ref = tp.row_parallel_linear(x, w, b), lin(full)
    close(y, y_ref)
    g = randn(3, 5, seed=2)
    y.backward(g)
    y_ref.backward(g)
    close(x.grad, full.grad[:, cols], what="input gradient")
    close(w.grad, lin.weight.grad[:, cols], what="weight gradient")
    close(b.grad, lin.bias.grad, what="bias gradient")


def _seq(rank, t):
    return lambda z: z.tensor_split(t, 1)[rank]


def case_ColumnParallelLinear():
    rank, t = rank_t()
    on_device(tp.ColumnParallelLinear(6, 8))
    lin = _linear(6, 8)
    ours = tp.ColumnParallelLinear.from_full(lin, sequence_parallel=True)      # input: a sequence shard
    feats = lambda z: z.tensor_split(t, -1)[rank]                               # noqa: E731
    _layer_vs_linear(ours, lin, (B, 8, 6), x_of=_seq(rank, t), out_of=feats, grad_of=_seq(rank, t),
                     expected=lambda g: tp.ColumnParallelLinear.from_full(g, sequence_parallel=True))


def case_RowParallelLinear():
    rank, t = rank_t()
    on_device(tp.RowParallelLinear(8, 6))
    lin = _linear(8, 6)
    ours = tp.RowParallelLinear.from_full(lin)
    feats = lambda z: z.tensor_split(t, -1)[rank]                               # noqa: E731
    _layer_vs_linear(ours, lin, (B, 5, 8), x_of=feats, grad_of=feats, expected=tp.RowParallelLinear.from_full)


def case_VocabParallelEmbedding():
    rank, t = rank_t()
    on_device(tp.VocabParallelEmbedding(10, 4))
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, device=dev())                 # 10 ids over 4 ranks: uneven shards
    ours = tp.VocabParallelEmbedding.from_full(emb)
    ids = torch.tensor([[0, 9, 3, 3], [5, 2, 7, 1]], device=dev())
    y, y_ref = ours(ids), emb(ids)
    close(y, y_ref)
    g = randn(2, 4, 4, seed=2)
    y.backward(g)
    y_ref.backward(g)
    close(ours.weight.grad, emb.weight.grad[ours.start:ours.stop], what="weight gradient")


# ----------------------------------------------------------------------------- tensor parallel: blocks
def case_ParallelMLP():
    torch.manual_seed(0)
    mlp = models.GPTMLP(CFG)
    on_device(tp.ParallelMLP(CFG.d_model, CFG.d_ff))
    _layer_vs_linear(tp.ParallelMLP.from_full(mlp), mlp, (B, 6, CFG.d_model), expected=tp.ParallelMLP.from_full)


def case_ParallelAttention():
    for n_kv in (2, 4):       # GQA with kv heads replicated over the 4 ranks, then split
        torch.manual_seed(0)
        attn = models.CausalSelfAttention(replace(CFG, n_kv_heads=n_kv))
        on_device(tp.ParallelAttention(CFG.d_model, CFG.n_heads, n_kv, seq_len=CFG.seq_len))
        _layer_vs_linear(tp.ParallelAttention.from_full(attn), attn, (B, 6, CFG.d_model),
                         expected=tp.ParallelAttention.from_full)


def _dropout_reference(tracker_seed, region, shape, p):
    rank = dist.get_rank()
    seed = tracker_seed if region == "replicated" else tracker_seed + 2718 + rank
    g = torch.Generator(dev()).manual_seed(seed)
    return (torch.rand(shape, generator=g, device=dev()) >= p).float() / (1 - p)


def case_RNGTracker():
    tracker = tp.RNGTracker(seed=3)
    for region in tp.RNGTracker.REGIONS:
        assert tracker.generator(region, dev()).device == dev()
        x = randn(64, seed=1, grad=True)
        y = tracker.dropout(x, 0.5, region)
        scale = _dropout_reference(3, region, (64,), 0.5)
        close(y, x.detach() * scale, what=f"{region} dropout")
        y.backward(torch.ones_like(y))
        close(x.grad, scale, what=f"{region} dropout gradient")
    masks = [torch.empty(64, device=dev()) for _ in range(WORLD)]
    dist.all_gather(masks, (tracker.dropout(torch.ones(64, device=dev()), 0.5, "parallel") != 0).float())
    assert not all(torch.equal(masks[0], m) for m in masks[1:]), "parallel masks are equal on every rank"


def case_ParallelDropout():
    drop = tp.ParallelDropout(0.25, tp.RNGTracker(seed=4), "replicated")
    x = randn(5, 7, seed=1, grad=True)
    y = drop(x)
    scale = _dropout_reference(4, "replicated", (5, 7), 0.25)
    close(y, x.detach() * scale)
    y.sum().backward()
    close(x.grad, scale, what="gradient")
    everyone = [torch.empty(5, 7, device=dev()) for _ in range(WORLD)]
    dist.all_gather(everyone, y.detach())
    assert all(torch.equal(everyone[0], e) for e in everyone), "replicated dropout differs between ranks"
    drop.eval()
    close(drop(x), x.detach(), what="eval output")


def case_vocab_parallel_cross_entropy():
    rank, t = rank_t()
    logits = randn(12, 10, seed=1)                        # 10 ids over 4 ranks: uneven
    target = torch.tensor([0, 9, 3, -100, 5, 2, 7, 1, 4, 6, 8, 9], device=dev())
    start, stop = tp.shard_range(10, rank, t)
    mine = logits[:, start:stop].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    loss, ref = tp.vocab_parallel_cross_entropy(mine, target, vocab_size=10), F.cross_entropy(full, target)
    close(loss, ref)
    loss.backward()
    ref.backward()
    close(mine.grad, full.grad[:, start:stop], what="logits gradient")


# ----------------------------------------------------------------------------- tensor parallel: SP
def case_sequence_parallel_linear():
    rank, t = rank_t()
    lin = _linear(6, 8)
    rows = slice(2 * rank, 2 * rank + 2)
    w, b = lin.weight.detach()[rows].clone().requires_grad_(), lin.bias.detach()[rows].clone().requires_grad_()
    full = randn(B, 8, 6, seed=1, grad=True)
    x = _seq(rank, t)(full.detach()).clone().requires_grad_()
    y, y_ref = tp.sequence_parallel_linear(x, w, b), lin(full)
    close(y, y_ref[..., rows])
    g = randn(B, 8, 8, seed=2)
    y.backward(g[..., rows])
    y_ref.backward(g)
    close(x.grad, _seq(rank, t)(full.grad), what="input gradient")
    close(w.grad, lin.weight.grad[rows], what="weight gradient")
    close(b.grad, lin.bias.grad[rows], what="bias gradient")


def case_scatter_to_sequence():
    rank, t = rank_t()
    x = randn(B, 8, 3, seed=1, grad=True)
    y = tp.scatter_to_sequence(x)
    close(y, _seq(rank, t)(x.detach()))
    y.backward(randn(B, 2, 3, seed=20 + rank))
    close(x.grad, torch.cat([randn(B, 2, 3, seed=20 + r) for r in range(t)], 1), what="gradient (all-gathered)")


def case_gather_from_sequence():
    rank, t = rank_t()
    full = randn(B, 8, 3, seed=1)
    x = _seq(rank, t)(full).clone().requires_grad_()
    y = tp.gather_from_sequence(x)
    close(y, full)
    g = randn(B, 8, 3, seed=2)
    y.backward(g)
    close(x.grad, _seq(rank, t)(g), what="gradient (my chunk)")


def _layer_norm_on_shards():
    """A LayerNorm on this rank's sequence shard, its marked gradients synced: the full gradients."""
    rank, t = rank_t()
    torch.manual_seed(0)
    ln = nn.LayerNorm(4, device=dev())
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.1)
        ln.bias.normal_(0.0, 0.1)
    ref = copy.deepcopy(ln)
    tp.mark_sequence_parallel(ln.weight, ln.bias)
    x, w = randn(B, 8, 4, seed=1), randn(B, 8, 4, seed=2)
    (ln(_seq(rank, t)(x)) * _seq(rank, t)(w)).sum().backward()
    (ref(x) * w).sum().backward()
    return ln, ref


def case_mark_sequence_parallel():
    ln, _ = _layer_norm_on_shards()
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel


def case_sequence_parallel_params():
    ln, _ = _layer_norm_on_shards()
    found = tp.sequence_parallel_params(ln)
    assert len(found) == 2 and found[0] is ln.weight and found[1] is ln.bias


def case_sync_sequence_parallel_grads():
    ln, ref = _layer_norm_on_shards()
    assert tp.sync_sequence_parallel_grads(ln) == 8 * 4
    close(ln.weight.grad, ref.weight.grad, what="weight gradient")
    close(ln.bias.grad, ref.bias.grad, what="bias gradient")


# ----------------------------------------------------------------------------- tensor parallel: model
def _block_case(sequence_parallel):
    rank, t = rank_t()
    block = models.TinyGPT(CFG).blocks[0]
    ours = tp.tensor_parallel_block(block, sequence_parallel=sequence_parallel)
    on_device(ours)
    cut = _seq(rank, t) if sequence_parallel else (lambda z: z)
    _layer_vs_linear(ours, block, (B, CFG.seq_len, CFG.d_model), x_of=cut, out_of=cut, grad_of=cut,
                     sync=sequence_parallel,
                     expected=lambda g: tp.tensor_parallel_block(g, sequence_parallel=sequence_parallel))


def case_tensor_parallel_block():
    _block_case(sequence_parallel=True)


def case_ParallelBlock():
    block = models.TinyGPT(CFG).blocks[0]
    parts = lambda b: tp.ParallelBlock(copy.deepcopy(b.ln_1), tp.ParallelAttention.from_full(b.attn),   # noqa: E731
                                       copy.deepcopy(b.ln_2), tp.ParallelMLP.from_full(b.mlp))
    _layer_vs_linear(parts(block), block, (B, CFG.seq_len, CFG.d_model), expected=parts)


def _gpt_case(build):
    model = models.TinyGPT(CFG)
    ours = build(model)
    on_device(ours)
    ids, targets = models.gpt_batch(0, B, CFG.seq_len, CFG.vocab)
    loss, ref = ours.loss(ours(ids), targets), models.gpt_loss(model(ids), targets)
    close(loss, ref, what="loss")
    loss.backward()
    ours.sync_grads()
    ref.backward()
    grads_close(ours, build(tp.grads_as_params(model)))


def case_tensor_parallel_gpt():
    _gpt_case(lambda m: tp.tensor_parallel_gpt(m, sequence_parallel=True))


def case_ParallelGPT():
    _gpt_case(lambda m: tp.ParallelGPT(m))


def case_grads_as_params():
    torch.manual_seed(0)
    mlp = models.GPTMLP(CFG)
    mlp(randn(B, 3, CFG.d_model, seed=1)).square().sum().backward()
    grads = tp.grads_as_params(mlp)
    for (n, p), q in zip(grads.named_parameters(), mlp.parameters()):
        close(p, q.grad, tol=0.0, what=n)


def case_max_grad_error():
    torch.manual_seed(0)
    mlp = models.GPTMLP(CFG)
    mlp(randn(B, 3, CFG.d_model, seed=1)).sum().backward()
    expected = tp.grads_as_params(mlp)
    assert tp.max_grad_error(mlp, expected) == 0.0
    with torch.no_grad():
        expected.proj.bias[1] += 0.25
    assert abs(tp.max_grad_error(mlp, expected) - 0.25) < 1e-6


def case_torch_parallelize():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    cfg = replace(CFG, n_kv_heads=4)      # torch's colwise k/v need t | kv heads
    model, ref = models.TinyGPT(cfg), models.TinyGPT(cfg)
    mesh = init_device_mesh(dev().type, (WORLD,))
    ours = tp.torch_parallelize(model, mesh)
    ids, targets = models.gpt_batch(0, B, cfg.seq_len, cfg.vocab)
    with loss_parallel():
        loss = models.gpt_loss(ours(ids), targets)
        loss.backward()
    expected = models.gpt_loss(ref(ids), targets)
    expected.backward()
    close(loss.full_tensor(), expected, what="loss")
    close(ours.lm_head.weight.grad.full_tensor(), ref.lm_head.weight.grad, what="LM head gradient")


# ----------------------------------------------------------------------------- context parallel
def _qkv(s, h, h_kv, d=4, seed=0):
    """Full (b, s, h, d) fp64 q, k, v, drawn alike on every rank."""
    q = randn(B, s, h, d, seed=seed, dtype=torch.float64)
    k, v = (randn(B, s, h_kv, d, seed=seed + i, dtype=torch.float64) for i in (1, 2))
    return q, k, v


def _attention_case(fn, causal, h_kv, cut, s=16, h=4, lse_of=None):
    """``fn(q, k, v)`` on this rank's pieces (``cut``) vs SDPA on the whole sequence, forward and
    backward (q, k, v gradients, cut the same way); ``lse_of`` checks a returned LSE."""
    q, k, v = _qkv(s, h, h_kv)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = sdpa(*(x.transpose(1, 2) for x in full), causal).transpose(1, 2)
    w = randn(*ref.shape, seed=9, dtype=torch.float64)
    (ref * w).sum().backward()
    mine = [cut(x).clone().requires_grad_() for x in (q, k, v)]
    out = fn(*mine)
    if lse_of is not None:
        out, lse = out
        lse_of(lse, q, k, causal)
    close(out, cut(ref.detach()), 1e-10, "output")
    (out * cut(w)).sum().backward()
    for name, x, f in zip("qkv", mine, full):
        close(x.grad, cut(f.grad), 1e-10, f"d{name}")


def _full_lse(q, k, causal):
    """(b, h, s) log-sum-exp of the scores of the whole sequence."""
    qh, kh = q.transpose(1, 2), models.repeat_kv(k.transpose(1, 2), q.size(2) // k.size(2))
    scores = qh @ kh.transpose(-2, -1) / q.size(-1) ** 0.5
    if causal:
        s = q.size(1)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=dev()).triu(1), float("-inf"))
    return scores.logsumexp(-1)


def case_ring_attention():
    rank, p = rank_t()
    for causal, zigzag, h_kv in ((True, False, 4), (True, True, 2), (False, False, 1)):
        cut = lambda x: cp.shard(x, rank, p, zigzag)                                  # noqa: E731
        lse_of = lambda lse, q, k, c: close(lse, cp.shard(_full_lse(q, k, c), rank, p, zigzag, dim=2),  # noqa: E731
                                            1e-10, "lse")
        _attention_case(lambda q, k, v: cp.ring_attention(q, k, v, causal, zigzag=zigzag, return_lse=True),
                        causal, h_kv, cut, lse_of=lse_of)


def case_ulysses_attention():
    rank, p = rank_t()
    for causal, h_kv in ((True, 4), (True, 2), (False, 1)):     # kv split, GQA replicated, MQA
        lse_of = lambda lse, q, k, c: close(lse, _full_lse(q, k, c)[:, rank:rank + 1], 1e-10, "lse")  # noqa: E731
        _attention_case(lambda q, k, v: cp.ulysses_attention(q, k, v, causal, return_lse=True), causal, h_kv,
                        lambda x: cp.shard(x, rank, p), lse_of=lse_of)


def case_local_attention():
    for causal in (True, False):
        _attention_case(lambda q, k, v: cp.local_attention(q, k, v, causal), causal, 2, lambda x: x,
                        lse_of=lambda lse, q, k, c: close(lse, _full_lse(q, k, c), 1e-10, "lse"))


def case_hybrid_attention():
    ulysses, ring = cp.new_hybrid_groups(2)
    u, r = dist.get_rank(ulysses), dist.get_rank(ring)
    cut = lambda x: cp.hybrid_shard(x, r, 2, u, 2, zigzag=True)                     # noqa: E731
    _attention_case(lambda q, k, v: cp.hybrid_attention(q, k, v, True, ulysses, ring, zigzag=True), True, 2, cut)


def case_new_hybrid_groups():
    ulysses, ring = cp.new_hybrid_groups(2)
    rank = dist.get_rank()
    assert dist.get_process_group_ranks(ulysses) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(ring) == [rank % 2, rank % 2 + 2]
    x = randn(3, seed=10 + rank)
    dist.all_reduce(x, group=ring)
    close(x, randn(3, seed=10 + rank % 2) + randn(3, seed=12 + rank % 2))


def case_hybrid_shard():
    x = randn(1, 16, 2, seed=1, grad=True)
    piece = cp.hybrid_shard(x, 1, 2, 0, 2, zigzag=True)          # ring shard 1 = chunks 1, 2 of 4; my half
    close(piece, x.detach()[:, 4:8])
    piece.sum().backward()
    close(x.grad, torch.zeros_like(x).index_fill(1, torch.arange(4, 8, device=dev()), 1.0), what="gradient")


def case_all_to_all():
    rank, p = rank_t()
    full = randn(B, 8, 4, 3, seed=1)
    x = cp.shard(full, rank, p).clone().requires_grad_()
    y = cp.all_to_all(x, 2, 1)                                  # sequence shard -> head shard
    close(y, full[:, :, rank:rank + 1])
    g = randn(B, 8, 4, 3, seed=2)
    y.backward(g[:, :, rank:rank + 1])
    close(x.grad, cp.shard(g, rank, p), what="gradient")


def case_seq_to_heads():
    _all_to_all_pair(cp.seq_to_heads)


def case_heads_to_seq():
    _all_to_all_pair(cp.heads_to_seq)


def _all_to_all_pair(fn):
    rank, p = rank_t()
    full = randn(B, 8, 4, 3, seed=1)
    seq, heads = cp.shard(full, rank, p), full[:, :, rank:rank + 1]
    x, want = (seq, heads) if fn is cp.seq_to_heads else (heads, seq)
    x = x.clone().requires_grad_()
    y = fn(x)
    close(y, want)
    y.backward(want * 2)
    close(x.grad, x.detach() * 2, what="gradient")


def case_merge_partial_attention():
    q, k, v = _qkv(6, 2, 2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-2, -1)
    parts = []
    for cols in (slice(0, 4), slice(4, 6)):        # two key sets
        s = scores[..., cols]
        parts.append((s.softmax(-1) @ vh[:, :, cols], s.logsumexp(-1)))
    (out_a, lse_a), (out_b, lse_b) = [(o.clone().requires_grad_(), lse) for o, lse in parts]
    out, lse = cp.merge_partial_attention(out_a, lse_a, out_b, lse_b)
    close(out, scores.softmax(-1) @ vh, 1e-10, "merged output")
    close(lse, scores.logsumexp(-1), 1e-10, "merged lse")
    out.sum().backward()
    close(out_a.grad, torch.sigmoid(lse_a - lse_b)[..., None].expand_as(out_a), 1e-10, "gradient of out_a")


def case_visible_window():
    q_pos, k_pos = torch.arange(4, 8, device=dev()), torch.arange(6, 10, device=dev())
    assert cp.visible_window(q_pos, k_pos, True) == (2, 2, True)       # rows 6, 7 see keys 6, 7
    assert cp.visible_window(q_pos, k_pos, False) == (0, 4, False)
    assert cp.visible_window(k_pos + 4, k_pos, True) == (0, 4, False)     # all keys earlier: no mask
    assert cp.visible_window(q_pos, k_pos + 10, True) is None


def case_shard():
    x = randn(1, 8, 2, seed=1, grad=True)
    piece = cp.shard(x, 1, 2, zigzag=True)
    close(piece, torch.cat([x.detach()[:, 2:4], x.detach()[:, 4:6]], 1))
    piece.sum().backward()
    close(x.grad, torch.zeros_like(x).index_fill(1, torch.arange(2, 6, device=dev()), 1.0), what="gradient")


def case_zigzag_shard():
    x = randn(1, 8, 2, seed=1, grad=True)
    piece = cp.zigzag_shard(x, 0, 2)
    close(piece, torch.cat([x.detach()[:, 0:2], x.detach()[:, 6:8]], 1))
    piece.sum().backward()
    close(x.grad, torch.zeros_like(x).index_fill(1, torch.tensor([0, 1, 6, 7], device=dev()), 1.0), what="gradient")


def case_unshard():
    x = randn(1, 12, 2, seed=1)
    for zigzag in (False, True):
        pieces = [cp.shard(x, r, 3, zigzag).clone().requires_grad_() for r in range(3)]
        whole = cp.unshard(pieces, zigzag)
        close(whole, x)
        whole.backward(x * 3)
        for r, piece in enumerate(pieces):
            close(piece.grad, cp.shard(x, r, 3, zigzag) * 3, what="gradient")


def case_shard_positions():
    pos = cp.shard_positions(8, 1, 2, zigzag=True)
    assert_real(pos)
    assert pos.device == dev() and pos.tolist() == [2, 3, 4, 5]
    assert cp.shard_positions(8, 1, 2, device="cpu").tolist() == [4, 5, 6, 7]


# ----------------------------------------------------------------------------- mesh
def case_make_mesh():
    mesh = mesh3d.make_mesh(1, 2, 2)
    assert mesh.device_type == dev().type
    mine = mesh3d.groups_of(dist.get_rank(), 1, 2, 2)
    for axis in mesh3d.AXES:
        assert dist.get_process_group_ranks(mesh.get_group(axis)) == mine[axis], axis
    x = randn(3, seed=10 + dist.get_rank())
    dist.all_reduce(x, group=mesh.get_group("tp"))
    close(x, sum(randn(3, seed=10 + r) for r in mine["tp"]))


def case_GPTStage():
    model = models.TinyGPT(CFG)
    ids, targets = models.gpt_batch(0, B, CFG.seq_len, CFG.vocab)
    stages = [mesh3d.GPTStage(model, k, 2) for k in range(2)]     # both stages here, TP over the 4 ranks
    for stage in stages:
        on_device(stage)
    act = stages[0](ids)
    assert tuple(act.shape) == stages[0].activation_shape(B, CFG.seq_len)
    loss, ref = stages[1].loss(stages[1](act), targets), models.gpt_loss(model(ids), targets)
    close(loss, ref, what="loss")
    loss.backward()
    ref.backward()
    grads = tp.grads_as_params(model)
    for k, stage in enumerate(stages):
        stage.sync_grads()
        grads_close(stage, mesh3d.GPTStage(grads, k, 2))


def _sgd_step(model, ids, targets, lr):
    loss = models.gpt_loss(model(ids), targets)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss


def case_Trainer3D():
    dp, pp, tp_ = 2, 2, 1
    batch, lr = 4, 0.1
    trainer = mesh3d.Trainer3D(models.TinyGPT(CFG), dp, pp, tp_, batch=batch, micro_batches=2, optimizer="sgd", lr=lr)
    on_device(trainer.stage)
    ids, targets = models.gpt_batch(0, batch, CFG.seq_len, CFG.vocab)
    loss = trainer.step(ids, targets)
    ref = models.TinyGPT(CFG)
    expected = _sgd_step(ref, ids, targets, lr)       # SGD's first step: momentum has nothing to add yet
    assert abs(loss - expected.item()) < 1e-5, (loss, expected.item())
    expected_stage = mesh3d.GPTStage(ref, trainer.i_pp, pp, trainer.tp_group)
    for (n, p), q in zip(trainer.stage.named_parameters(), expected_stage.parameters(), strict=True):
        close(p.detach(), q.detach(), what=f"weight {n} after the step")


# ----------------------------------------------------------------------------- harness
H_CFG = models.GPTConfig(vocab=16, d_model=8, n_heads=2, n_layers=2, seq_len=4)


def case_reference_run():
    losses, state = h3d.reference_run(H_CFG, 2, 4, optimizer="sgd", lr=0.1)
    for name, t in state.items():
        assert_real(t)
        assert t.device == dev(), f"{name} is on {t.device}"
    ids, targets = models.gpt_batch(0, 4, H_CFG.seq_len, H_CFG.vocab)
    initial = models.TinyGPT(H_CFG)
    first = models.gpt_loss(ref_gpt(initial, ids), targets).item()
    assert abs(losses[0] - first) < 1e-6, (losses, first)
    assert not torch.equal(state["lm_head.weight"], initial.lm_head.weight.detach()), "no step was taken"


def case_layouts_on_rank():
    steps, batch = 2, 4
    ref_losses, ref_state = h3d.reference_run(H_CFG, steps, batch, optimizer="sgd", lr=0.1)
    (out,) = h3d.layouts_on_rank([h3d.Layout(1, 2, 2)], H_CFG, steps, batch, torch.float32, "sgd", 0.1, ref_state)
    assert out["weight_err"] <= 1e-5, out["weight_err"]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(out["losses"], ref_losses, strict=True)), (out["losses"], ref_losses)
    assert out["traffic"]["tp"] and out["traffic"]["pp"], out["traffic"]
    assert all(s == s and s >= 0 for s in out["step_s"])


CASES = {f"minidist.{name}": Case(WORLD, body) for name, body in {
    # models (GPT)
    "models.repeat_kv": case_repeat_kv, "models.causal_attention": case_causal_attention,
    "models.CausalSelfAttention": case_causal_self_attention, "models.GPTMLP": case_gpt_mlp,
    "models.GPTBlock": case_gpt_block, "models.TinyGPT": case_tiny_gpt, "models.gpt_loss": case_gpt_loss,
    "models.gpt_batch": case_gpt_batch,
    # tensor parallel
    "tensor_parallel.copy_to_tp": case_copy_to_tp, "tensor_parallel.reduce_from_tp": case_reduce_from_tp,
    "tensor_parallel.gather_along_dim": case_gather_along_dim,
    "tensor_parallel.reduce_scatter_along_dim": case_reduce_scatter_along_dim,
    "tensor_parallel.split_along_dim": case_split_along_dim, "tensor_parallel.gather_from_tp": case_gather_from_tp,
    "tensor_parallel.new_tp_group": case_new_tp_group, "tensor_parallel.tp_rank": case_tp_rank,
    "tensor_parallel.tp_size": case_tp_size,
    "tensor_parallel.column_parallel_linear": case_column_parallel_linear,
    "tensor_parallel.row_parallel_linear": case_row_parallel_linear,
    "tensor_parallel.ColumnParallelLinear": case_ColumnParallelLinear,
    "tensor_parallel.RowParallelLinear": case_RowParallelLinear,
    "tensor_parallel.VocabParallelEmbedding": case_VocabParallelEmbedding,
    "tensor_parallel.ParallelMLP": case_ParallelMLP, "tensor_parallel.ParallelAttention": case_ParallelAttention,
    "tensor_parallel.RNGTracker": case_RNGTracker, "tensor_parallel.ParallelDropout": case_ParallelDropout,
    "tensor_parallel.vocab_parallel_cross_entropy": case_vocab_parallel_cross_entropy,
    "tensor_parallel.sequence_parallel_linear": case_sequence_parallel_linear,
    "tensor_parallel.scatter_to_sequence": case_scatter_to_sequence,
    "tensor_parallel.gather_from_sequence": case_gather_from_sequence,
    "tensor_parallel.mark_sequence_parallel": case_mark_sequence_parallel,
    "tensor_parallel.sequence_parallel_params": case_sequence_parallel_params,
    "tensor_parallel.sync_sequence_parallel_grads": case_sync_sequence_parallel_grads,
    "tensor_parallel.ParallelBlock": case_ParallelBlock,
    "tensor_parallel.tensor_parallel_block": case_tensor_parallel_block,
    "tensor_parallel.ParallelGPT": case_ParallelGPT, "tensor_parallel.tensor_parallel_gpt": case_tensor_parallel_gpt,
    "tensor_parallel.grads_as_params": case_grads_as_params, "tensor_parallel.max_grad_error": case_max_grad_error,
    "tensor_parallel.torch_parallelize": case_torch_parallelize,
    # context parallel
    "context_parallel.all_to_all": case_all_to_all, "context_parallel.seq_to_heads": case_seq_to_heads,
    "context_parallel.heads_to_seq": case_heads_to_seq, "context_parallel.local_attention": case_local_attention,
    "context_parallel.visible_window": case_visible_window,
    "context_parallel.merge_partial_attention": case_merge_partial_attention,
    "context_parallel.ring_attention": case_ring_attention,
    "context_parallel.ulysses_attention": case_ulysses_attention, "context_parallel.shard": case_shard,
    "context_parallel.zigzag_shard": case_zigzag_shard, "context_parallel.unshard": case_unshard,
    "context_parallel.shard_positions": case_shard_positions,
    "context_parallel.hybrid_attention": case_hybrid_attention, "context_parallel.hybrid_shard": case_hybrid_shard,
    "context_parallel.new_hybrid_groups": case_new_hybrid_groups,
    # mesh
    "mesh.make_mesh": case_make_mesh, "mesh.GPTStage": case_GPTStage, "mesh.Trainer3D": case_Trainer3D,
    # harness
    "harness.parallel3d.reference_run": case_reference_run, "harness.parallel3d.layouts_on_rank": case_layouts_on_rank,
}.items()}

_PURE = "pure arithmetic on ints (no tensor, no process group)"
EXEMPT = {
    "minidist.models.GPTConfig": "a frozen dataclass of sizes",
    "minidist.tensor_parallel.SEQ_DIM": "a constant (the sequence dim, 1)",
    "minidist.tensor_parallel.shard_range": _PURE,
    "minidist.tensor_parallel.kv_layout": _PURE,
    "minidist.context_parallel.kv_heads_per_rank": _PURE,
    "minidist.mesh.AXES": "a constant (the axis names)",
    "minidist.mesh.LOSS_DTYPE": "a constant (a dtype)",
    "minidist.mesh.check_layout": _PURE,
    "minidist.mesh.check_3d": "validation of sizes: ints and a schedule's plan, no tensor",
    "minidist.mesh.coordinate": _PURE,
    "minidist.mesh.rank_of": _PURE,
    "minidist.mesh.mesh_groups": _PURE,
    "minidist.mesh.groups_of": _PURE,
    "minidist.mesh.innermost_contiguous": _PURE,
    "minidist.mesh.rank_grid": "a printable table of ints",
    "minidist.mesh.stage_layers": _PURE,
    "minidist.harness.parallel3d.Layout": "a frozen dataclass of a layout's sizes",
    "minidist.harness.parallel3d.axis_of": "matches a group's rank list to a mesh axis: ints only",
    "minidist.harness.parallel3d.predict": "the cost model's numbers (ints and floats, no tensor)",
    "minidist.harness.parallel3d.compare": "arithmetic on the ranks' returned numbers, in the parent (no tensor)",
    "minidist.harness.parallel3d.run_layouts": ("the parent side of a launch, which a case body (inside a rank) "
                                                 "cannot start; its rank side is layouts_on_rank's case, and the 3D "
                                                 "tour row runs it whole with meta as the ranks' default device"),
}
