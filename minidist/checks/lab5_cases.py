"""Lab 5's cases, one per graded function: a forward and a backward on this rank against the
single-process module, and the collectives it traced against the cost model.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3) give each function's values and its f/g traffic;
Korthikanti et al. 2022 (Sec. 4.2.2) the sequence-parallel all-gathers and reduce-scatters;
:mod:`minidist.cost.tensor_parallel` the bytes. A runner takes (fn, name, case, group rank r,
group size t, group) and returns (problems, [{phase: trace} per call], {phase: expected
Counter}, extra), where ``extra`` may accept leftover traffic (the SP block's optional
re-gather and its partial-gradient all-reduces) or carry traffic the runner traced itself (the
loss). Every case proves the caller's tensors (arguments, a module's weights) unchanged and
the output in the input's dtype; a module is used for two calls in a row (a second step).
Inputs are drawn on the CPU from their seed and copied to the rank's device
(``minidist.device()``); references run on the CPU, and results are compared there.
Used by :mod:`minidist.checks.lab5_tensor_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist import cost
from minidist.checks.common import TOL
from minidist.checks.groups import consecutive_groups, wrong_group_hint
from minidist.checks.returned import not_plain_tensor
from minidist.models import GPTConfig, TinyGPT
from minidist.runtime.device import device as rank_device
from minidist.tensor_parallel.comm import shard_range
from minidist.trace import trace

WORLD, B, S = 4, 2, 12                 # S divisible by 1, 2, 3 and 4 (sequence shards)
CFG = GPTConfig(vocab=48, d_model=24, n_heads=12, d_ff=48, n_layers=1, seq_len=S)
SEQ = 1                                # activations are (batch, seq, hidden)
TOLS = {torch.bfloat16: 2e-2}          # relative; TOL for fp32 and fp64 (sums of t bf16 numbers round)

# ----------------------------------------------------------------------------- groups, data
def _groups(ts) -> dict:
    """{t: (group, rank in it, its size)}: blocks of t consecutive ranks of the 4."""
    return consecutive_groups(ts, WORLD)


def _randn(shape, seed, dtype=torch.float32):
    """Drawn on the CPU from its seed: the same numbers on every rank and device."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype, device="cpu")


def _dev(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """A copy of CPU tensor ``t`` on this rank's device (a leaf that requires grad when asked)."""
    out = t.detach().to(rank_device(), copy=True)
    return out.requires_grad_() if grad else out


def _part(x, dim, r, t):
    return x.tensor_split(t, dim=dim)[r]


def _masked(full, dim, r, t):
    """The gradient rank r's slice of a replicated parameter gets: its chunk, zeros elsewhere."""
    out = torch.zeros_like(full)
    a, b = shard_range(full.shape[dim], r, t)
    out.narrow(dim, a, b - a).copy_(full.narrow(dim, a, b - a))
    return out


def _err(what, got, want):
    if got is None:
        return f"{what} is None: no gradient reached it (was it detached, or built outside autograd?)"
    if problem := not_plain_tensor(what, got, want.shape):
        return problem
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return (f"{what} is {str(got.dtype).replace('torch.', '')}, expected {str(want.dtype).replace('torch.', '')} "
                f"(the inputs' dtype: make every buffer with the dtype of the tensor it holds)")
    tol = TOLS.get(want.dtype, TOL)
    got, want = got.detach().cpu().double(), want.double()
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= tol * max(1.0, want.abs().max().item() if want.numel() else 1.0):
        ratio = ""
        if want.norm() > 0:
            ratio = f", |got|/|expected| = {(got.norm() / want.norm()).item():.3f}"
        return f"{what} differs from one process (max |error| {diff:.3g}{ratio})"
    return None


# ----------------------------------------------------------------------------- traffic
FAMILY = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
          "all_gather": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
          "reduce_scatter_single": "reduce-scatter", "reduce_scatter": "reduce-scatter"}


def _traffic(tr, t) -> Counter:
    """(kind, payload bytes) of every traced op (the tracer counts a list all_gather's input, as the tensor form's)."""
    out = Counter()
    for e in tr.comm():
        out[FAMILY.get(e.op, e.op), e.nbytes] += 1
    return out


def _expected(colls, phase) -> Counter:
    return Counter((FAMILY[c.op], c.nbytes) for c in colls if c.phase == phase)


def _show(c: Counter) -> str:
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def _compare_traffic(got: dict, want: dict, extra=None) -> str | None:
    """``got``/``want``: {phase: Counter}. ``extra(phase, leftover) -> bool`` may accept what is left over."""
    for phase in ("forward", "backward"):
        g, w = got[phase], want.get(phase, Counter())
        if g == w or (extra is not None and not (w - g) and extra(phase, g - w)):
            continue
        return f"{phase} communicated {_show(g)}; expected {_show(w)}"
    return None


# ----------------------------------------------------------------------------- one case per kind
def _snapshot(args, names) -> list:
    """(name, tensor, copy) of the caller's tensors among ``args``; a module's parameters by name."""
    held = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            held.append((name, a, a.detach().clone()))
        elif isinstance(a, nn.Module):
            held += [(f"{name}.{n}", q, q.detach().clone()) for n, q in a.named_parameters()]
    return held


def _changed(held, when: str) -> str | None:
    for name, now, was in held:
        if not torch.equal(now.detach(), was):
            return (f"the caller's {name} changed during {when}: a graded function leaves its inputs as it "
                    f"found them (reduce into a tensor you own, e.g. a clone, not into the caller's)")
    return None


def _run(fn, args, upstream, names):
    """Forward then backward of sum(out * upstream) under the tracer: (output, {phase: trace}, problem),
    the problem being a caller's tensor changed in forward or backward."""
    held = _snapshot(args, names)
    with trace() as tf:
        out = fn(*args)
    changed = _changed(held, "the forward")
    with trace() as tb:
        (out * upstream).sum().backward() if upstream is not None else out.backward()
    return out, {"forward": tf, "backward": tb}, changed or _changed(held, "the backward")


def _hinted(problem, got, want, world, t):
    """``problem`` with the wrong-group diagnosis added when ``got`` is the sum over the world's ranks."""
    hint = problem and wrong_group_hint(got, want, world, t, WORLD)
    return f"{problem}.{hint}" if hint else problem


def _case_f_g(fn, name, case, r, t, group):
    shape, dtype = case["shape"], case["dtype"]
    seeds = range(dist.get_rank() - r, dist.get_rank() - r + t)          # the global ranks of my group
    if name == "copy_to_tp":
        x = _randn(shape, 1, dtype)
        leaf = _dev(x, grad=True)
        ups = [_randn(shape, 100 + s, dtype) for s in seeds]            # each rank's own upstream gradient
        out, tr, changed = _run(fn, (leaf * 1, group), _dev(ups[r]), ("x",))
        world = sum(_randn(shape, 100 + s, dtype) for s in range(WORLD))  # what an all-reduce without group= sums
        errs = [changed, _err("the output", out, x),
                _hinted(_err("x.grad", leaf.grad, sum(ups)), leaf.grad, sum(ups), world, t)]
        want = {"backward": _expected([cost.TPCollective("backward", "all_reduce", x.numel() * x.element_size())],
                                      "backward")}
    else:
        xs = [_randn(shape, 200 + s, dtype) for s in seeds]              # each rank's own partial sum
        up = _randn(shape, 7, dtype)                                     # replicated upstream gradient
        leaf = _dev(xs[r], grad=True)
        out, tr, changed = _run(fn, (leaf * 1, group), _dev(up), ("x",))
        world = sum(_randn(shape, 200 + s, dtype) for s in range(WORLD))
        errs = [changed, _hinted(_err("the output", out, sum(xs)), out, sum(xs), world, t),
                _err("x.grad", leaf.grad, up)]
        want = {"forward": _expected([cost.TPCollective("forward", "all_reduce", up.numel() * up.element_size())],
                                     "forward")}
    return errs, [tr], want, None


def _case_linear(fn, name, case, r, t, group):
    d_in, d_out, bias, dtype = case["d_in"], case["d_out"], case["bias"], case["dtype"]
    torch.manual_seed(3)
    lin = nn.Linear(d_in, d_out, bias=bias, dtype=dtype, device="cpu")
    x = _randn((*case["lead"], d_in), 4, dtype).requires_grad_()
    up = _randn((*case["lead"], d_out), 5, dtype)
    (lin(x) * up).sum().backward()
    y_ref = lin(x).detach()
    tokens = x.numel() // d_in
    if name == "column_parallel_linear":
        w = _dev(_part(lin.weight, 0, r, t), grad=True)
        b = _dev(_part(lin.bias, 0, r, t), grad=True) if bias else None
        xin = _dev(x, grad=True)
        out, tr, changed = _run(fn, (xin, w, b, group), _dev(_part(up, -1, r, t)), ("x", "weight", "bias"))
        errs = [changed, _err("the output", out, _part(y_ref, -1, r, t)), _err("x.grad", xin.grad, x.grad),
                _err("weight.grad", w.grad, _part(lin.weight.grad, 0, r, t))]
        colls = cost.column_parallel_collectives(tokens, d_in, d_out, t, elem_bytes=x.element_size()) if t > 1 else []
    else:
        w = _dev(_part(lin.weight, 1, r, t), grad=True)
        b = _dev(lin.bias, grad=True) if bias else None
        xin = _dev(_part(x, -1, r, t), grad=True)
        out, tr, changed = _run(fn, (xin, w, b, group), _dev(up), ("x", "weight", "bias"))
        errs = [changed, _err("the output", out, y_ref), _err("x.grad", xin.grad, _part(x.grad, -1, r, t)),
                _err("weight.grad", w.grad, _part(lin.weight.grad, 1, r, t))]
        colls = cost.row_parallel_collectives(tokens, d_in, d_out, t, elem_bytes=x.element_size()) if t > 1 else []
    if bias:
        errs.append(_err("bias.grad", b.grad, _part(lin.bias.grad, 0, r, t) if name.startswith("column")
                         else lin.bias.grad))
    return errs, [tr], {p: _expected(colls, p) for p in ("forward", "backward")}, None


def _sharded_grads(ref: nn.Module, mine: nn.Module, r, t, dims: dict) -> list:
    """Each parameter's gradient on this rank: its chunk along dims[name] (None: replicated, whole)."""
    errs = []
    for (pname, p_ref), (_, p) in zip(ref.named_parameters(), mine.named_parameters()):
        dim = dims.get(pname)
        want = p_ref.grad if dim is None else _masked(p_ref.grad, dim, r, t)
        errs.append(_err(f"{pname}.grad", p.grad, want))
    return errs


ATTN_DIMS = {"q.weight": 0, "q.bias": 0, "k.weight": 0, "k.bias": 0, "v.weight": 0, "v.bias": 0, "o.weight": 1}
MLP_DIMS = {"fc.weight": 0, "fc.bias": 0, "proj.weight": 1}


def _two_calls(fn, args, names, up, check) -> tuple[list, list]:
    """``fn`` twice on the same module (gradients cleared between), as two training steps would:
    hooks registered on every call pile up, state kept from the first call shows in the second."""
    errs, traces = [], []
    for call in range(2):
        for q in (q for a in args if isinstance(a, nn.Module) for q in a.parameters()):
            q.grad = None
        xin = _dev(args[0], grad=True)
        out, tr, changed = _run(fn, (xin, *args[1:]), _dev(up), names)
        found = [changed] + check(out, xin)
        errs += found if call == 0 else [e and f"{e} (second call on the same module)" for e in found]
        traces.append(tr)
    return errs, traces


def _case_module(fn, name, case, r, t, group):
    cfg = dataclasses.replace(CFG, **case.get("cfg", {}))
    dtype = case.get("dtype", torch.float32)
    block = TinyGPT(cfg, device="cpu").blocks[0].to(dtype)
    ref = block.mlp if name == "tp_mlp" else block.attn
    mine = copy.deepcopy(ref).to(rank_device())
    x = _randn((B, S, cfg.d_model), 8, dtype).requires_grad_()
    up = _randn((B, S, cfg.d_model), 9, dtype)
    (ref(x) * up).sum().backward()
    if case.get("raises") and (cfg.n_heads % t or cfg.n_kv_heads % t):
        try:
            with trace() as tf:
                fn(_dev(x, grad=True), mine, group)
        except ValueError:
            return [None if not tf.comm() else "raised ValueError only after communicating: check the sizes first, "
                    "before any collective (the other ranks would wait for you)"], [], None, None
        return [f"returned although {cfg.n_heads} query and {cfg.n_kv_heads} key/value heads do not both split over "
                f"t = {t}; the lab asks for a ValueError (attention is split by whole heads)"], [], None, None
    dims = MLP_DIMS if name == "tp_mlp" else ATTN_DIMS
    errs, traces = _two_calls(fn, (x, mine, group), ("x", name.split("_")[1]), up, lambda out, xin: [
        _err("the output", out, ref(x).detach()), _err("x.grad", xin.grad, x.grad), *_sharded_grads(ref, mine, r, t, dims)])
    colls = cost.tp_layer_collectives(B, S, cfg.d_model, t, sublayers=1, elem_bytes=x.element_size()) if t > 1 else []
    return errs, traces, {p: _expected(colls, p) for p in ("forward", "backward")}, None


def _case_ce(fn, name, case, r, t, group):
    vocab, ignore, lead = case["vocab"], case["ignore_index"], case["lead"]
    logits = case["scale"] * _randn((*lead, vocab), 11, case.get("dtype", torch.float32))
    target = torch.randint(0, vocab, lead, generator=torch.Generator().manual_seed(12), device="cpu").flatten()
    bounds = sorted({b for rr in range(t) for b in shard_range(vocab, rr, t)} - {vocab})
    target[:len(bounds)] = torch.tensor(bounds, device="cpu")              # first id of every shard
    target[len(bounds):2 * len(bounds)] = torch.tensor([b - 1 for b in bounds[1:]] + [vocab - 1], device="cpu")  # last
    target[2 * len(bounds)::5] = ignore
    target = target.view(lead)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, -2), target.flatten(), ignore_index=ignore)
    ref.backward()
    a, b = shard_range(vocab, r, t)
    mine, target_here = _dev(logits[..., a:b], grad=True), _dev(target)
    kwargs = {"vocab_size": vocab} if case["uneven"] else {}
    held = _snapshot((mine, target_here), ("logits", "target"))
    with trace() as tf:
        loss = fn(mine, target_here, group, ignore, **kwargs)
    changed = _changed(held, "the forward")
    with trace() as tb:
        loss.backward()
    errs = [changed or _changed(held, "the backward"), _err("the loss", loss, ref.detach()),
            _err("logits.grad", mine.grad, full.grad[..., a:b])]
    tokens = target.numel()
    want = {p: _expected(cost.vocab_parallel_ce_collectives(tokens, t, logits.element_size()) if t > 1 else [], p)
            for p in ("forward", "backward")}
    got = {"forward": _traffic(tf, t), "backward": _traffic(tb, t)}
    e = logits.element_size()      # the target logit and the sum of exp may share one all-reduce
    if t > 1 and got["forward"] == Counter({("all-reduce", e * tokens): 1, ("all-reduce", 2 * e * tokens): 1}):
        got["forward"] = want["forward"]
    return errs, [], want, got


def _case_sp(fn, name, case, r, t, group):
    seeds = range(dist.get_rank() - r, dist.get_rank() - r + t)
    dtype = case.get("dtype", torch.float32)
    full = _randn((B, S, CFG.d_model), 21, dtype)
    shard_bytes, full_bytes = full.nbytes // t, full.nbytes
    if name == "sp_gather":
        ups = [_randn(full.shape, 300 + s, dtype) for s in seeds]            # per-rank partial gradients
        leaf = _dev(_part(full, SEQ, r, t), grad=True)
        out, tr, changed = _run(fn, (leaf * 1, group), _dev(ups[r]), ("x",))
        errs = [changed, _err("the output", out, full), _err("x.grad", leaf.grad, _part(sum(ups), SEQ, r, t))]
        want = {"forward": Counter({("all-gather", shard_bytes): 1}),
                "backward": Counter({("reduce-scatter", full_bytes): 1})}
    else:
        xs = [_randn(full.shape, 400 + s, dtype) for s in seeds]
        up = _randn(full.shape, 22, dtype)
        leaf = _dev(xs[r], grad=True)
        out, tr, changed = _run(fn, (leaf * 1, group), _dev(_part(up, SEQ, r, t)), ("x",))
        errs = [changed, _err("the output", out, _part(sum(xs), SEQ, r, t)), _err("x.grad", leaf.grad, up)]
        want = {"forward": Counter({("reduce-scatter", full_bytes): 1}),
                "backward": Counter({("all-gather", shard_bytes): 1})}
    return errs, [tr], (want if t > 1 else {}), None


def _case_sp_block(fn, name, case, r, t, group):
    dtype = case.get("dtype", torch.float32)
    block = TinyGPT(CFG, device="cpu").blocks[0].to(dtype)
    ln, mlp = block.ln_2, block.mlp
    ln_s, mlp_s = copy.deepcopy(ln).to(rank_device()), copy.deepcopy(mlp).to(rank_device())
    x = _randn((B, S, CFG.d_model), 31, dtype).requires_grad_()
    up = _randn((B, S, CFG.d_model), 32, dtype)
    y = x + mlp(ln(x))
    (y * up).sum().backward()

    def check(out, xin):
        return ([_err("the output", out, _part(y.detach(), SEQ, r, t)), _err("x.grad", xin.grad, _part(x.grad, SEQ, r, t))]
                + [_err(f"ln.{n}.grad", p.grad, p_ref.grad) for (n, p_ref), p in zip(ln.named_parameters(), ln_s.parameters())]
                + [f"mlp.{e}" if e else None for e in _sharded_grads(mlp, mlp_s, r, t, MLP_DIMS)])
    errs, traces = _two_calls(fn, (_part(x.detach(), SEQ, r, t), ln_s, mlp_s, group), ("x", "ln", "mlp"),
                              _part(up, SEQ, r, t), check)
    e = x.element_size()
    colls = cost.tp_layer_collectives(B, S, CFG.d_model, t, sequence_parallel=True, sublayers=1,
                                      elem_bytes=e) if t > 1 else []
    want = {p: _expected(colls, p) for p in ("forward", "backward")}
    regather = ("all-gather", B * S * CFG.d_model * e // t)
    want["backward"][regather] -= 1         # the re-gather of the saved shard is optional (memory for traffic)
    want["backward"] = +want["backward"]
    partial = e * sum(p.numel() for p in (ln.weight, ln.bias, mlp.proj.bias))

    def sums_partial_grads(phase, leftover):
        """Backward may re-gather the input shard once, and must all-reduce the partial gradients of
        LayerNorm and the output bias (3h numbers: one all-reduce or several)."""
        if phase != "backward":
            return False
        leftover = Counter(leftover)
        leftover[regather] -= min(1, leftover[regather])
        ars = {k: n for k, n in (+leftover).items() if k[0] == "all-reduce"}
        return set(+leftover) == set(ars) and sum(b * n for (_, b), n in ars.items()) == partial
    return errs, traces, want, sums_partial_grads


CASE_RUNNERS = {"copy_to_tp": _case_f_g, "reduce_from_tp": _case_f_g, "column_parallel_linear": _case_linear,
                "row_parallel_linear": _case_linear, "tp_mlp": _case_module, "tp_attention": _case_module,
                "vocab_parallel_cross_entropy": _case_ce, "sp_gather": _case_sp, "sp_reduce_scatter": _case_sp,
                "sp_mlp_block": _case_sp_block}
