"""Tensor and sequence parallelism (minidist.tensor_parallel), measured, not asserted.

Every distributed case of one world size runs inside ONE ``minidist.launch`` (a suite of
cases per rank, results cached per world size), so the file stays fast on 2 cores. Each
rank checks itself against the single-process ``minidist.models`` reference it builds
from the same seed, and returns numbers; the tests below assert on them:

* forward and every gradient (input, weights, biases, LayerNorm) equal the reference for
  t in {1, 2, 3, 4}: fp64 within 1e-10, fp32 within 1e-5 (absolute, or relative to the
  largest reference value where that exceeds 1);
* equal to torch's own tensor parallelism (parallelize_module + loss_parallel, CPU gloo);
* traced collectives per layer (kind, count, payload bytes) equal minidist.cost's list;
* activation bytes saved by autograd equal minidist.cost.tp_activation_bytes exactly;
* TP groups of 2 inside 4 ranks; the dropout RNG property; every ValueError is raised
  before any collective.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel  # noqa: F401  (imported once here: forked ranks inherit it)
import torch.nn as nn

import minidist
from minidist import cost
from minidist.memory import saved_activation_bytes
from minidist.models import GPTConfig, TinyGPT, gpt_batch, gpt_loss
from minidist.tensor_parallel import (ColumnParallelLinear, ParallelAttention, ParallelMLP, RNGTracker,
                                      RowParallelLinear, VocabParallelEmbedding, column_parallel_linear, copy_to_tp,
                                      gather_along_dim, gather_from_tp, kv_layout, new_tp_group, reduce_from_tp,
                                      reduce_scatter_along_dim, row_parallel_linear, split_along_dim,
                                      sync_sequence_parallel_grads, tensor_parallel_block, tensor_parallel_gpt,
                                      torch_parallelize, vocab_parallel_cross_entropy)
from minidist.tensor_parallel.comm import shard_range
from minidist.trace import trace
from conftest import attempt

# Sizes divisible by 1, 2, 3 and 4 (12 heads of 2 dims, 12 tokens), so every t runs everything.
CFG = GPTConfig(vocab=48, d_model=24, n_heads=12, d_ff=48, n_layers=2, seq_len=12)
B = 2
DTYPES = (torch.float64, torch.float32)
TOL = {"float64": 1e-10, "float32": 1e-5}
KV_HEADS = (12, 6, 4, 3, 2, 1)


# ============================================================================= helpers (run in ranks)
def _err(a, b) -> float:
    """Max |a − b|, relative to the largest |b| when that exceeds 1 (a sum of 14 losses
    is ~70, where one fp32 ulp is already 8e-6)."""
    if not a.numel():
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _grads_as_params(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters hold its gradients: cut it the way the TP
    module was cut and its parameters are the gradients each rank must have."""
    g = copy.deepcopy(module)
    for p, q in zip(g.parameters(), module.parameters()):
        p.data = q.grad.detach().clone()
    return g


def _grad_err(ours: nn.Module, expected: nn.Module) -> float:
    worst = 0.0
    for (n, p), (m, q) in zip(ours.named_parameters(), expected.named_parameters(), strict=True):
        assert n == m and p.grad is not None, (n, m)
        worst = max(worst, _err(p.grad, q))
    return worst


def _phases(fwd, bwd) -> dict:
    return {"forward": sorted((e.op, e.nbytes) for e in fwd.comm()),
            "backward": sorted((e.op, e.nbytes) for e in bwd.comm())}


def _theory(collectives) -> dict:
    return {ph: sorted((c.op, c.nbytes) for c in collectives if c.phase == ph) for ph in ("forward", "backward")}


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _seq_shard(x, group):
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    return x.tensor_split(t, dim=1)[rank]


# ============================================================================= cases (run in ranks)
def _case_comm(group):
    """Each op's forward and backward against values worked out by hand."""
    r, t = dist.get_rank(group), dist.get_world_size(group)
    tri = t * (t + 1) / 2
    out = {}
    x = torch.ones(2, 3, requires_grad=True)
    (copy_to_tp(x, group) * (r + 1)).sum().backward()                    # f: grads summed
    out["f"] = max(_err(copy_to_tp(x, group), x), _err(x.grad, torch.full((2, 3), tri)))
    x = torch.full((2, 3), r + 1.0, requires_grad=True)
    y = reduce_from_tp(x, group)
    y.sum().backward()                                                  # g: identity backward
    out["g"] = max(_err(y, torch.full((2, 3), tri)), _err(x.grad, torch.ones(2, 3)))
    for dim in (0, 1, -1):
        full = torch.arange(2 * t * 3 * t * 2 * t * 1.0).view(2 * t, 3 * t, 2 * t)
        mine = full.tensor_split(t, dim)[r]
        x = mine.clone().requires_grad_()
        y = gather_along_dim(x, dim, group)
        (y * (r + 1)).sum().backward()                                  # partial grads: reduce-scattered
        out[f"gather dim {dim}"] = max(_err(y, full), _err(x.grad, torch.full_like(mine, tri)))
        x = full.clone().requires_grad_()
        y = reduce_scatter_along_dim(x * (r + 1), dim, group)
        (y * y.new_full(y.shape, r + 1.0)).sum().backward()             # backward: all-gather
        w = torch.cat([torch.full_like(c, k + 1.0) for k, c in enumerate(full.tensor_split(t, dim))], dim)
        out[f"reduce-scatter dim {dim}"] = max(_err(y, mine * tri), _err(x.grad, w * (r + 1)))
        x = full.clone().requires_grad_()
        y = split_along_dim(x, dim, group)
        (y * (r + 1)).sum().backward()
        out[f"split dim {dim}"] = max(_err(y, mine), _err(x.grad, w))
        x = mine.clone().requires_grad_()
        y = gather_from_tp(x, dim, group)
        (y * full).sum().backward()                                     # replicated consumer: keep my chunk
        out[f"gather_from_tp dim {dim}"] = max(_err(y, full), _err(x.grad, mine))
    return out


def _case_layers(group, dtype):
    r, t = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(1)
    lin = nn.Linear(12, 24).to(dtype)
    x0 = _inputs((B, 5, 12), dtype)
    errs, comm = {}, {}

    def reference(module, x):
        module.zero_grad()
        x = x.clone().requires_grad_()
        y = module(x)
        (y * _inputs(y.shape, dtype, 7)).sum().backward()
        return y, x.grad

    y_ref, gx_ref = reference(lin, x0)
    rows = slice(*shard_range(24, r, t))
    for gather in (False, True):
        col = ColumnParallelLinear.from_full(lin, group, gather_output=gather)
        x = x0.clone().requires_grad_()
        with trace() as tf:
            y = col(x)
        w = _inputs(y_ref.shape, dtype, 7)
        with trace() as tb:
            (y * (w if gather else w[..., rows])).sum().backward()
        errs[f"column gather={gather}"] = max(_err(y, y_ref if gather else y_ref[..., rows]), _err(x.grad, gx_ref),
                                              _err(col.weight.grad, lin.weight.grad[rows]),
                                              _err(col.bias.grad, lin.bias.grad[rows]))
        comm[f"column gather={gather}"] = (_phases(tf, tb), _theory(cost.column_parallel_collectives(
            B * 5, 12, 24, t, gather_output=gather, elem_bytes=dtype.itemsize)))

    lin = nn.Linear(24, 12).to(dtype)
    x0 = _inputs((B, 5, 24), dtype, 2)
    y_ref, gx_ref = reference(lin, x0)
    cols = slice(*shard_range(24, r, t))
    for parallel_input in (True, False):
        row = RowParallelLinear.from_full(lin, group, input_is_parallel=parallel_input)
        x = (x0[..., cols] if parallel_input else x0).clone().requires_grad_()
        with trace() as tf:
            y = row(x)
        with trace() as tb:
            (y * _inputs(y.shape, dtype, 7)).sum().backward()
        errs[f"row parallel_input={parallel_input}"] = max(
            _err(y, y_ref), _err(x.grad, gx_ref[..., cols] if parallel_input else gx_ref),
            _err(row.weight.grad, lin.weight.grad[:, cols]), _err(row.bias.grad, lin.bias.grad))
        if parallel_input:
            comm["row"] = (_phases(tf, tb), _theory(cost.row_parallel_collectives(B * 5, 24, 12, t,
                                                                                   elem_bytes=dtype.itemsize)))
    # functional forms, as lab 5 states them
    lin = nn.Linear(12, 24).to(dtype)
    y = column_parallel_linear(x0[..., :12], lin.weight[rows], lin.bias[rows], group)
    errs["column_parallel_linear"] = _err(y, lin(x0[..., :12])[..., rows])
    lin = nn.Linear(24, 12).to(dtype)
    errs["row_parallel_linear"] = _err(row_parallel_linear(x0[..., cols], lin.weight[:, cols], lin.bias, group), lin(x0))

    for vocab in (48, 11):                                              # 11: uneven shards
        emb = nn.Embedding(vocab, 6).to(dtype)
        starts = [shard_range(vocab, k, t)[0] for k in range(t)] + [vocab - 1]
        ids = torch.tensor([starts + [max(s - 1, 0) for s in starts], list(range(2 * len(starts)))]) % vocab
        ref = emb(ids)
        (ref * _inputs(ref.shape, dtype, 3)).sum().backward()
        ours = VocabParallelEmbedding.from_full(emb, group)
        y = ours(ids)
        (y * _inputs(ref.shape, dtype, 3)).sum().backward()
        errs[f"embedding vocab={vocab}"] = max(_err(y, ref), _err(ours.weight.grad, emb.weight.grad[ours.start:ours.stop]))
    return errs, comm


def _case_mlp(group, dtype, sp):
    t = dist.get_world_size(group)
    ref = TinyGPT(CFG).to(dtype).blocks[0].mlp
    ours = ParallelMLP.from_full(ref, group, sequence_parallel=sp)
    x_full = _inputs((B, CFG.seq_len, CFG.d_model), dtype).requires_grad_()
    w = _inputs(x_full.shape, dtype, 5)
    (ref(x_full) * w).sum().backward()
    x = (_seq_shard(x_full, group) if sp else x_full).detach().clone().requires_grad_()
    with trace() as tf:
        y = ours(x)
    with trace() as tb:
        (y * (_seq_shard(w, group) if sp else w)).sum().backward()
    sync_sequence_parallel_grads(ours, group)
    y_ref = ref(x_full)
    err = max(_err(y, _seq_shard(y_ref, group) if sp else y_ref),
              _err(x.grad, _seq_shard(x_full.grad, group) if sp else x_full.grad),
              _grad_err(ours, ParallelMLP.from_full(_grads_as_params(ref), group, sequence_parallel=sp)))
    theory = cost.tp_layer_collectives(B, CFG.seq_len, CFG.d_model, t, sequence_parallel=sp,
                                       elem_bytes=dtype.itemsize, sublayers=1)
    return err, (_phases(tf, tb), _theory(theory))


def _case_attention(group, dtype, n_kv):
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    cfg = GPTConfig(**{**CFG.__dict__, "n_kv_heads": n_kv})
    ref = TinyGPT(cfg).to(dtype).blocks[0].attn
    ours = ParallelAttention.from_full(ref, group)
    x_full = _inputs((B, cfg.seq_len, cfg.d_model), dtype).requires_grad_()
    w = _inputs(x_full.shape, dtype, 5)
    y_ref = ref(x_full)
    (y_ref * w).sum().backward()
    x = x_full.detach().clone().requires_grad_()
    with trace() as tf:
        y = ours(x)
    with trace() as tb:
        (y * w).sum().backward()
    err = max(_err(y, y_ref), _err(x.grad, x_full.grad),
              _grad_err(ours, ParallelAttention.from_full(_grads_as_params(ref), group)))
    theory = (cost.tp_layer_collectives(B, cfg.seq_len, cfg.d_model, t, elem_bytes=dtype.itemsize, sublayers=1)
              + cost.kv_replica_collectives(n_kv, cfg.head_dim, cfg.d_model, t, elem_bytes=dtype.itemsize))
    return err, (_phases(tf, tb), _theory(theory)), kv_layout(cfg.n_heads, n_kv, t, rank)[2]


def _case_cross_entropy(group, dtype):
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    errs, comm = {}, None
    for vocab, ignore_index in ((11, -100), (48, -100), (11, 3)):
        start, stop = shard_range(vocab, rank, t)
        logits = (_inputs((B, 7, vocab), dtype) * 3).requires_grad_()
        bounds = [shard_range(vocab, k, t)[i] for k in range(t) for i in (0, 1)]
        target = torch.tensor([b - d for b in bounds for d in (0, 1)] * 8)[:B * 7].clamp(0, vocab - 1)
        target[::5] = ignore_index                                      # some tokens ignored
        target = target.view(B, 7)
        for reduction in ("mean", "sum", "none"):
            ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=ignore_index,
                                                    reduction=reduction)
            w = _inputs(ref.shape, dtype, 9) if reduction == "none" else torch.ones((), dtype=dtype)
            (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
            mine = logits.detach()[..., start:stop].clone().requires_grad_()
            with trace() as tf:
                loss = vocab_parallel_cross_entropy(mine, target, group, ignore_index, vocab_size=vocab,
                                                    reduction=reduction)
            with trace() as tb:
                (loss.flatten() * w).sum().backward()
            errs[f"vocab={vocab} ignore={ignore_index} {reduction}"] = max(
                _err(loss.flatten(), ref.flatten()), _err(mine.grad, g_ref[..., start:stop]))
            comm = (_phases(tf, tb), _theory(cost.vocab_parallel_ce_collectives(B * 7, t, dtype.itemsize)))
    return errs, comm


def _case_block(group, dtype, sp):
    t = dist.get_world_size(group)
    ref = TinyGPT(CFG).to(dtype).blocks[1]
    ours = tensor_parallel_block(ref, group, sequence_parallel=sp)
    x_full = _inputs((B, CFG.seq_len, CFG.d_model), dtype).requires_grad_()
    w = _inputs(x_full.shape, dtype, 5)
    y_ref = ref(x_full)
    (y_ref * w).sum().backward()
    x = (_seq_shard(x_full, group) if sp else x_full).detach().clone().requires_grad_()
    with trace() as tf:
        y = ours(x)
    with trace() as tb:
        (y * (_seq_shard(w, group) if sp else w)).sum().backward()
    with trace() as ts:
        synced = sync_sequence_parallel_grads(ours, group) if sp else 0
    expected = tensor_parallel_block(_grads_as_params(ref), group, sequence_parallel=sp)
    err = max(_err(y, _seq_shard(y_ref, group) if sp else y_ref),
              _err(x.grad, _seq_shard(x_full.grad, group) if sp else x_full.grad), _grad_err(ours, expected))
    theory = cost.tp_layer_collectives(B, CFG.seq_len, CFG.d_model, t, sequence_parallel=sp, elem_bytes=dtype.itemsize)
    sync = [(e.op, e.nbytes) for e in ts.comm()]
    return err, (_phases(tf, tb), _theory(theory)), (sync, synced)


def _case_gpt(group, dtype, sp, cfg=CFG, step=0):
    t = dist.get_world_size(group)
    ref = TinyGPT(cfg).to(dtype)
    ids, targets = gpt_batch(step, B, cfg.seq_len, cfg.vocab)
    loss_ref = gpt_loss(ref(ids), targets)
    loss_ref.backward()
    ours = tensor_parallel_gpt(ref, group, sequence_parallel=sp)
    with trace() as tr:
        logits = ours(ids)
        loss = ours.loss(logits, targets)
        loss.backward()
        ours.sync_grads()
    expected = tensor_parallel_gpt(_grads_as_params(ref), group, sequence_parallel=sp)
    theory = cost.tp_gpt_collectives(B, cfg.seq_len, cfg.d_model, cfg.n_layers, t, sequence_parallel=sp,
                                     elem_bytes=dtype.itemsize)
    groups = {e.group for e in tr.comm()}
    return (max(_err(loss, loss_ref), _grad_err(ours, expected)),
            (sorted((e.op, e.nbytes) for e in tr.comm()), sorted((c.op, c.nbytes) for c in theory)), groups)


def _case_memory(group, sp, dropout, dtype=torch.float32):
    t = dist.get_world_size(group)
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    ref = TinyGPT(cfg).to(dtype).blocks[0]
    ours = tensor_parallel_block(ref, group, sequence_parallel=sp)
    x = _inputs((B, cfg.seq_len, cfg.d_model), dtype)
    x = (_seq_shard(x, group) if sp else x).contiguous().requires_grad_()
    _, measured = saved_activation_bytes(ours, x, exclude=ours)
    formula = cost.tp_activation_bytes(cfg.seq_len, B, cfg.d_model, cfg.n_heads, t, sequence_parallel=sp,
                                       d_ff=cfg.d_ff, dropout=dropout > 0, elem_bytes=dtype.itemsize)
    return measured, formula


def _case_dropout(group):
    """Masks of the tracker, and of whole blocks, collected for comparison across ranks."""
    rng = RNGTracker(seed=5, group=group)
    out = {region: rng.dropout(torch.ones(4096), 0.5, region) != 0 for region in RNGTracker.REGIONS}
    out["parallel again"] = rng.dropout(torch.ones(4096), 0.5, "parallel") != 0
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": 0.3})
    for sp in (False, True):
        block = tensor_parallel_block(TinyGPT(cfg).blocks[0], group, sequence_parallel=sp, rng=RNGTracker(7, group))
        seen = {}
        for name in ("attn_drop", "resid_drop"):
            getattr(block.attn, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o != 0))
        x = _inputs((B, cfg.seq_len, cfg.d_model), torch.float32)
        y = block(_seq_shard(x, group) if sp else x)
        out[f"sp={sp}"] = {"out": y.detach(), **seen}
    return out


def _case_errors(group):
    t = dist.get_world_size(group)
    lin = nn.Linear(t * 4 + 1, t * 4 + 1)
    good = ColumnParallelLinear(8, 8 * t, group=group)
    model = TinyGPT(GPTConfig(**{**CFG.__dict__, "vocab": 4 * t + 1, "seq_len": 4 * t + 1}))
    cases = {
        "column out_features": lambda: ColumnParallelLinear.from_full(lin, group),
        "row in_features": lambda: RowParallelLinear.from_full(lin, group),
        "weight shard shape": lambda: good.load_shard(torch.zeros(9, 8)),
        "bias shard shape": lambda: good.load_shard(good.weight.detach(), torch.zeros(9)),
        "mlp d_ff": lambda: ParallelMLP(8, 4 * t + 1, group=group),
        "heads": lambda: ParallelAttention(6 * t + 3, 2 * t + 1, seq_len=4, group=group),
        "kv heads": lambda: ParallelAttention(24 * t, 12 * t, 3 if t != 3 else 2, seq_len=4, group=group),
        "group larger than world": lambda: new_tp_group(dist.get_world_size() + 1),
        "world not divisible": lambda: new_tp_group(dist.get_world_size() + 1 if t == 1 else 3 if t == 4 else 5),
        "vocab not divisible (GPT)": lambda: tensor_parallel_gpt(model, group),
        "ce vocab_size vs logits": lambda: vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.zeros(2).long(),
                                                                        group, vocab_size=5 * t + 7),
        "ce target out of range": lambda: vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.tensor([0, 5 * t]),
                                                                       group),
        "embedding ids out of range": lambda: VocabParallelEmbedding(8, 4, group=group)(torch.tensor([[8]])),
        "column input features (SP)": lambda: column_parallel_linear(torch.zeros(1, t, 7), good.weight, good.bias,
                                                                     group, sequence_parallel=True),
        "row seq not divisible (SP)": lambda: row_parallel_linear(torch.zeros(1, t + 1, 8), torch.zeros(8, 8), None,
                                                                  group, sequence_parallel=True),
        "embedding seq not divisible (SP)": lambda: VocabParallelEmbedding(8, 4, group=group, sequence_parallel=True)(
            torch.zeros(1, t + 1, dtype=torch.long)),
    }
    if t == 1:    # nothing to split: only the shape and range checks apply
        cases = {k: cases[k] for k in ("weight shard shape", "bias shard shape", "group larger than world",
                                       "ce vocab_size vs logits", "ce target out of range", "embedding ids out of range")}
    return {name: attempt(fn) for name, fn in cases.items()}


def _case_torch(group, sp):
    """Our TP next to torch's parallelize_module + loss_parallel, same weights, fp64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    t = dist.get_world_size()
    cfg = GPTConfig(**{**CFG.__dict__, "n_kv_heads": 6 if t == 2 else 4})
    ref = TinyGPT(cfg).double()
    ids, targets = gpt_batch(3, B, cfg.seq_len, cfg.vocab)
    ours = tensor_parallel_gpt(ref, group, sequence_parallel=sp)
    logits = ours(ids)
    loss = ours.loss(logits, targets)
    loss.backward()
    ours.sync_grads()
    theirs = torch_parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (t,)), sequence_parallel=sp)
    their_logits = theirs(ids)
    with loss_parallel():
        their_loss = gpt_loss(their_logits, targets)
        their_loss.backward()
    full = lambda z: z.full_tensor() if hasattr(z, "full_tensor") else z  # noqa: E731
    grads = copy.deepcopy(ref)
    for (n, p), (m, q) in zip(grads.named_parameters(), theirs.named_parameters(), strict=True):
        p.data = full(q.grad).detach().clone()
    return max(_err(loss, full(their_loss)), _err(logits, their_logits.to_local()),
               _grad_err(ours, tensor_parallel_gpt(grads, group, sequence_parallel=sp)))


# ============================================================================= the suite
def _suite(torch_tp: bool):
    group, out = None, {}
    t = dist.get_world_size()
    out["comm"] = _case_comm(group)
    for dtype in DTYPES:
        d = _name(dtype)
        out["layers", d], out["layers comm", d] = _case_layers(group, dtype)
        out["ce", d], out["ce comm", d] = _case_cross_entropy(group, dtype)
        for sp in (False, True):
            out["mlp", d, sp] = _case_mlp(group, dtype, sp)
            out["block", d, sp] = _case_block(group, dtype, sp)
            out["gpt", d, sp] = _case_gpt(group, dtype, sp)
        for n_kv in KV_HEADS:
            if (n_kv % t == 0 or t % n_kv == 0) and (dtype == torch.float64 or n_kv in (12, 1)):
                out["attention", d, n_kv] = _case_attention(group, dtype, n_kv)
    for sp in (False, True):
        for p in (0.0, 0.1):
            out["memory", sp, p] = _case_memory(group, sp, p)
    out["memory fp64"] = _case_memory(group, True, 0.1, torch.float64)
    out["errors"] = _case_errors(group)
    if t > 1:
        out["dropout"] = _case_dropout(group)
    if torch_tp:
        for sp in (False, True):
            out["torch", sp] = _case_torch(group, sp)
    return out


def _subgroup_suite():
    """World of 4 cut into TP groups [0, 1] and [2, 3], each on its own data (2-way DP x 2-way TP)."""
    group = new_tp_group(2)
    dp = dist.get_rank() // 2
    cfg = GPTConfig(**{**CFG.__dict__, "seed": dp})
    out = {}
    for sp in (False, True):
        out["gpt", sp] = _case_gpt(group, torch.float64, sp, cfg=cfg, step=dp)
        out["block", sp] = _case_block(group, torch.float64, sp)[:2]
    out["groups"] = (dist.get_process_group_ranks(group),)
    return out


@functools.lru_cache(maxsize=None)
def run(t: int) -> list[dict]:
    return minidist.launch(_suite, t, t in (2, 4), timeout=120)


@functools.lru_cache(maxsize=None)
def run_subgroups() -> list[dict]:
    return minidist.launch(_subgroup_suite, 4, timeout=120)


def _entries(t, kind):
    for rank, res in enumerate(run(t)):
        for key, value in res.items():
            if (key[0] if isinstance(key, tuple) else key) == kind:
                yield rank, key, value


WORLDS = [1, 2, 3, 4]


# ============================================================================= tests
@pytest.mark.parametrize("t", WORLDS)
def test_differentiable_collectives_forward_and_backward(t):
    for rank, _, errs in _entries(t, "comm"):
        bad = {k: v for k, v in errs.items() if v > 0}
        assert not bad, f"t={t} rank {rank}: {bad}"


@pytest.mark.parametrize("t", WORLDS)
def test_layers_equal_single_process(t):
    for rank, (_, dtype), errs in _entries(t, "layers"):
        bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
        assert not bad, f"t={t} rank {rank} {dtype}: {bad}"


@pytest.mark.parametrize("t", WORLDS)
@pytest.mark.parametrize("kind", ["mlp", "block", "gpt"])
def test_mlp_block_and_gpt_equal_single_process(t, kind):
    for rank, (_, dtype, sp), value in _entries(t, kind):
        assert value[0] <= TOL[dtype], f"{kind} t={t} rank {rank} {dtype} sp={sp}: max error {value[0]:.3g}"


@pytest.mark.parametrize("t", WORLDS)
def test_attention_by_heads_equals_single_process_incl_gqa(t):
    seen = set()
    for rank, (_, dtype, n_kv), (err, _, replicated) in _entries(t, "attention"):
        assert err <= TOL[dtype], f"t={t} rank {rank} {dtype} n_kv_heads={n_kv}: max error {err:.3g}"
        seen.add((n_kv, replicated))
    expected = {n for n in KV_HEADS if n % t == 0 or t % n == 0}
    assert {n for n, _ in seen} == expected
    if t in (2, 4):
        assert any(rep for _, rep in seen), "a replicated-kv (GQA/MQA) case must have run"


@pytest.mark.parametrize("t", WORLDS)
def test_vocab_parallel_cross_entropy(t):
    for rank, (_, dtype), errs in _entries(t, "ce"):
        bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
        assert not bad, f"t={t} rank {rank} {dtype}: {bad}"


@pytest.mark.parametrize("t", WORLDS)
@pytest.mark.parametrize("kind", ["layers comm", "ce comm", "mlp", "block", "attention"])
def test_traced_collectives_equal_theory(t, kind):
    for rank, key, value in _entries(t, kind):
        items = value.items() if kind == "layers comm" else [(key, value if kind == "ce comm" else value[1])]
        for name, (traced, theory) in items:
            assert traced == theory, f"{kind} {name} t={t} rank {rank}:\n traced {traced}\n theory {theory}"


@pytest.mark.parametrize("t", [2, 4])
def test_collectives_per_layer_are_megatrons(t):
    """The counts, spelled out: 2 all-reduces forward + 2 backward without SP; with SP 2
    all-gathers + 2 reduce-scatters forward (and 4 + 2 backward, the re-gather included)."""
    from collections import Counter
    for _, (_, dtype, sp), (_, (traced, _), _) in _entries(t, "block"):
        fwd, bwd = Counter(op for op, _ in traced["forward"]), Counter(op for op, _ in traced["backward"])
        if sp:
            assert fwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
            assert bwd == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2}
        else:
            assert fwd == {"all_reduce": 2} and bwd == {"all_reduce": 2}


@pytest.mark.parametrize("t", WORLDS)
def test_sequence_parallel_grad_sync_reduces_layernorm_and_row_biases_once(t):
    for rank, (_, dtype, sp), (_, _, (sync, nbytes)) in _entries(t, "block"):
        if sp and t > 1:
            expected = 6 * CFG.d_model * torch.empty((), dtype=getattr(torch, dtype)).element_size()
            assert sync == [("all_reduce", expected)] and nbytes == expected


@pytest.mark.parametrize("t", WORLDS)
def test_gpt_step_traffic_equals_theory(t):
    for rank, (_, dtype, sp), (_, (traced, theory), _) in _entries(t, "gpt"):
        assert traced == theory, f"t={t} rank {rank} {dtype} sp={sp}"


@pytest.mark.parametrize("t", WORLDS)
def test_activation_memory_equals_formula(t):
    for rank, key, (measured, formula) in _entries(t, "memory"):
        assert measured == formula, f"t={t} rank {rank} {key}: measured {measured} B, formula {formula} B"
    for rank, res in enumerate(run(t)):
        measured, formula = res["memory fp64"]
        assert measured == formula


@pytest.mark.parametrize("t", WORLDS)
def test_every_value_error_comes_before_any_collective(t):
    for rank, _, cases in _entries(t, "errors"):
        for name, (kind, message, events) in cases.items():
            assert kind == "ValueError", f"t={t} rank {rank} {name}: got {kind}: {message}"
            assert events == 0, f"t={t} rank {rank} {name}: {events} collective(s) before the error"


@pytest.mark.parametrize("t", [2, 4])
def test_dropout_rng_differs_inside_parallel_region_and_matches_outside(t):
    out = [res["dropout"] for res in run(t)]
    for r in range(1, t):
        assert torch.equal(out[r]["replicated"], out[0]["replicated"])
        assert not torch.equal(out[r]["parallel"], out[0]["parallel"])
        # no SP: the block's output is replicated, so its residual dropout masks match ...
        assert torch.equal(out[r]["sp=False"]["out"], out[0]["sp=False"]["out"])
        assert torch.equal(out[r]["sp=False"]["resid_drop"], out[0]["sp=False"]["resid_drop"])
        # ... while each rank's heads (and, under SP, its tokens) get their own masks
        for sp in (False, True):
            assert not torch.equal(out[r][f"sp={sp}"]["attn_drop"], out[0][f"sp={sp}"]["attn_drop"])
        assert not torch.equal(out[r]["sp=True"]["resid_drop"], out[0]["sp=True"]["resid_drop"])
    for o in out:
        assert not torch.equal(o["parallel"], o["parallel again"])        # the stream advances
        assert 0.4 < o["parallel"].float().mean() < 0.6


@pytest.mark.parametrize("t", [2, 4])
def test_equal_to_torch_tensor_parallel(t):
    for rank, (_, sp), err in _entries(t, "torch"):
        assert err <= 1e-10, f"t={t} rank {rank} sp={sp}: ours vs torch max difference {err:.3g}"


def test_tp_groups_of_two_inside_four_ranks():
    out = run_subgroups()
    for rank, res in enumerate(out):
        assert res["groups"] == ([0, 1] if rank < 2 else [2, 3],)
        for sp in (False, True):
            err, (traced, theory), groups = res["gpt", sp]
            assert err <= 1e-10 and traced == theory
            assert groups == {(0, 1) if rank < 2 else (2, 3)}, groups
            err, (phases, expected) = res["block", sp]
            assert err <= 1e-10 and phases == expected


# ============================================================================= formulas (no launch)
def test_our_activation_terms_reduce_to_the_papers_formula():
    """With 2-byte activations, 1-byte masks and LayerNorm's statistics ignored, the
    term-by-term count of our block is Korthikanti et al.'s, for every t, with and without SP."""
    s, b, h, a = 2048, 4, 1024, 16
    for t in (1, 2, 4, 8):
        for sp in (False, True):
            ours = cost.tp_activation_bytes(s, b, h, a, t, sequence_parallel=sp, dropout=True, elem_bytes=2,
                                            stat_bytes=0)
            assert ours == pytest.approx(cost.tp_activation_bytes_paper(s, b, h, a, t, sp), rel=1e-12)
    assert cost.tp_activation_bytes_paper(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def test_sequence_parallel_moves_the_same_wire_bytes_forward():
    """Korthikanti et al.: reduce-scatter + all-gather = all-reduce on a ring."""
    for t in (2, 4, 8):
        tp = cost.tp_layer_collectives(2, 64, 32, t)
        sp = cost.tp_layer_collectives(2, 64, 32, t, sequence_parallel=True)
        fwd = lambda cs: [c for c in cs if c.phase == "forward"]    # noqa: E731
        assert cost.tp_wire_bytes(fwd(sp), t) == pytest.approx(cost.tp_wire_bytes(fwd(tp), t))


def test_comm_time_is_the_ring_alpha_beta_model():
    """tp_comm_time of an all-reduce is cost.allreduce_time's ring; SP's forward (RS + AG per
    all-reduce) takes exactly TP's forward time; a group of one takes none; a slower link
    (β nine times larger) makes the β term nine times larger."""
    from minidist.cost.tensor_parallel import INFINIBAND_NDR, NVLINK_H100, Link, tp_comm_time
    link = Link("test", alpha=2e-6, bandwidth=100e9)
    for t in (2, 3, 4, 8):
        one = [cost.TPCollective("forward", "all_reduce", 4096)]
        assert tp_comm_time(one, t, link) == pytest.approx(
            cost.allreduce_time("ring", t, 4096, link.alpha, link.beta), rel=1e-12)
        tp = [c for c in cost.tp_layer_collectives(2, 24, 32, t) if c.phase == "forward"]
        sp = [c for c in cost.tp_layer_collectives(2, 24, 32, t, sequence_parallel=True) if c.phase == "forward"]
        assert tp_comm_time(sp, t, link) == pytest.approx(tp_comm_time(tp, t, link), rel=1e-12)
        no_alpha = [Link("", 0.0, lk.bandwidth) for lk in (NVLINK_H100, INFINIBAND_NDR)]
        fast, slow = (tp_comm_time(tp, t, lk) for lk in no_alpha)
        assert slow == pytest.approx(9 * fast, rel=1e-12)
    assert tp_comm_time(cost.tp_layer_collectives(2, 24, 32, 1), 1, link) == 0


def test_layer_flops_are_three_forwards():
    """72bsh²(1 + s/6h) = 3 × (24bsh² + 4bs²h): forward, and a backward of twice its cost."""
    from minidist.cost.tensor_parallel import tp_layer_flops
    b, s, h = 2, 2048, 1024
    assert tp_layer_flops(b, s, h) == pytest.approx(3 * (24 * b * s * h * h + 4 * b * s * s * h), rel=1e-12)


def test_gpt_reference_lands_on_the_device_asked_with_the_cpu_numbers():
    """TinyGPT and gpt_batch draw on the CPU whatever torch's default device, then move to
    ``device=``: a GPU rank's reference is the same numbers as a CPU rank's."""
    expected, (ids, targets) = TinyGPT(CFG), gpt_batch(3, B, CFG.seq_len, CFG.vocab)
    with torch.device("meta"):          # what a forgotten device= would silently follow
        model = TinyGPT(CFG, device="cpu")
        batch = gpt_batch(3, B, CFG.seq_len, CFG.vocab, device="cpu")
        elsewhere = TinyGPT(CFG, device="meta")
    for (n, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
        assert a.device.type == "cpu" and torch.equal(a, b), n
    assert torch.equal(batch[0], ids) and torch.equal(batch[1], targets)
    assert {t.device.type for t in [*elsewhere.parameters(), *elsewhere.buffers()]} == {"meta"}
    assert gpt_batch(0, B, CFG.seq_len, CFG.vocab, device="meta")[0].device.type == "meta"
