"""Lab 5's cases, one runner per kind of graded function: a forward and a backward on this rank
against the single-process module, and the collectives it traced against the cost model.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3) give each function's values and its f/g traffic;
Korthikanti et al. 2022 (Sec. 4.2.2) the sequence-parallel all-gathers and reduce-scatters;
:mod:`minidist.cost.tensor_parallel` the bytes. A runner is judged
(:class:`minidist.checks.groups.RankRunner`): its ``answer`` runs the student's function on group
rank r of t and returns what it did as plain data (outputs, gradients, digests of the caller's
tensors after each phase, the traffic of each phase); its ``verdict`` rebuilds the inputs and the
reference from seeds (:mod:`minidist.checks.lab5_data`) and lists the problems, so the grader's
judge gives it again. Every case proves the caller's tensors (arguments, a module's weights)
unchanged and the output in the input's dtype; a module is used for two calls in a row (a second
step). Group rank s draws its own data from seed ``base + s``.
Used by :mod:`minidist.checks.lab5_tensor_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from minidist import cost
from minidist.checks.docket import digest
from minidist.checks.groups import RankRunner, attempt, raise_verdict
from minidist.checks.lab5_data import (B, CFG, S, SEQ, _dev, _err, _expected, _hinted, _masked, _part, _randn, _traffic,
                                       _untouched, _with_traffic, _world, counted)
from minidist.models import TinyGPT
from minidist.runtime.device import device as rank_device
from minidist.tensor_parallel.comm import shard_range
from minidist.trace import trace


# ----------------------------------------------------------------------------- shared by the runners
def _call(fn, args, upstream, held: dict, kwargs=None) -> dict:
    """Forward, then backward of sum(out * upstream) (or out.backward()), each under the tracer: the
    output, each phase's traffic, and digests of the caller's tensors ``held`` after each phase."""
    with trace() as tf:
        out = fn(*args, **(kwargs or {}))
    after_forward = {n: digest(x) for n, x in held.items() if x is not None}
    with trace() as tb:
        (out * upstream).sum().backward() if upstream is not None else out.backward()
    return {"out": out, "forward": _traffic(tf), "backward": _traffic(tb),
            "held": [after_forward, {n: digest(x) for n, x in held.items() if x is not None}]}


# ----------------------------------------------------------------------------- f and g (and SP's pair)
def _f_g_data(name, case, r, t):
    shape, dtype = case["shape"], case["dtype"]
    if name == "copy_to_tp":        # replicated input; each rank's own upstream gradient
        return dict(x=_randn(shape, 1, dtype), ups=[_randn(shape, 100 + s, dtype) for s in range(t)], base=100)
    return dict(xs=[_randn(shape, 200 + s, dtype) for s in range(t)], up=_randn(shape, 7, dtype), base=200)


def f_g_answer(fn, name, case, r, t, group):
    d = _f_g_data(name, case, r, t)
    leaf = _dev(d["x"] if name == "copy_to_tp" else d["xs"][r], grad=True)
    given = leaf * 1
    upstream = _dev(d["ups"][r] if name == "copy_to_tp" else d["up"])
    return {**_call(fn, (given, group), upstream, {"x": given}), "grad": leaf.grad}


def f_g_verdict(name, case, r, t, answer):
    d = _f_g_data(name, case, r, t)
    world = _world(case["shape"], d["base"], case["dtype"], t)
    if name == "copy_to_tp":
        x, total = d["x"], sum(d["ups"])
        errs = [_untouched(answer, {"x": x}), _err("the output", answer["out"], x),
                _hinted(_err("x.grad", answer["grad"], total), answer["grad"], total, world, t)]
        want = {"backward": Counter({("all-reduce", x.numel() * x.element_size()): 1})}
    else:
        total, up = sum(d["xs"]), d["up"]
        errs = [_untouched(answer, {"x": d["xs"][r]}),
                _hinted(_err("the output", answer["out"], total), answer["out"], total, world, t),
                _err("x.grad", answer["grad"], up)]
        want = {"forward": Counter({("all-reduce", up.numel() * up.element_size()): 1})}
    return _with_traffic(errs, t, [answer], want)


def _sp_data(name, case, r, t):
    dtype = case.get("dtype", torch.float32)
    full = _randn((B, S, CFG.d_model), 21, dtype)
    if name == "sp_gather":         # per-rank partial gradients
        return dict(full=full, ups=[_randn(full.shape, 300 + s, dtype) for s in range(t)])
    return dict(full=full, xs=[_randn(full.shape, 400 + s, dtype) for s in range(t)], up=_randn(full.shape, 22, dtype))


def sp_answer(fn, name, case, r, t, group):
    d = _sp_data(name, case, r, t)
    gather = name == "sp_gather"
    leaf = _dev(_part(d["full"], SEQ, r, t) if gather else d["xs"][r], grad=True)
    given = leaf * 1
    upstream = _dev(d["ups"][r] if gather else _part(d["up"], SEQ, r, t))
    return {**_call(fn, (given, group), upstream, {"x": given}), "grad": leaf.grad}


def sp_verdict(name, case, r, t, answer):
    d = _sp_data(name, case, r, t)
    full = d["full"]
    shard_bytes, full_bytes = full.nbytes // t, full.nbytes
    if name == "sp_gather":
        errs = [_untouched(answer, {"x": _part(full, SEQ, r, t)}), _err("the output", answer["out"], full),
                _err("x.grad", answer["grad"], _part(sum(d["ups"]), SEQ, r, t))]
        want = {"forward": Counter({("all-gather", shard_bytes): 1}),
                "backward": Counter({("reduce-scatter", full_bytes): 1})}
    else:
        errs = [_untouched(answer, {"x": d["xs"][r]}), _err("the output", answer["out"], _part(sum(d["xs"]), SEQ, r, t)),
                _err("x.grad", answer["grad"], d["up"])]
        want = {"forward": Counter({("reduce-scatter", full_bytes): 1}),
                "backward": Counter({("all-gather", shard_bytes): 1})}
    return _with_traffic(errs, t, [answer], want)


# ----------------------------------------------------------------------------- column- and row-parallel linear
def _linear_data(name, case, r, t):
    """The layer, its slices on rank r, and the single-process reference's output and gradients."""
    d_in, d_out, bias, dtype = case["d_in"], case["d_out"], case["bias"], case["dtype"]
    torch.manual_seed(3)
    lin = nn.Linear(d_in, d_out, bias=bias, dtype=dtype, device="cpu")
    x = _randn((*case["lead"], d_in), 4, dtype).requires_grad_()
    up = _randn((*case["lead"], d_out), 5, dtype)
    (lin(x) * up).sum().backward()
    y, column = lin(x).detach(), name == "column_parallel_linear"
    cut = (lambda p, dim: _part(p, dim, r, t))
    return dict(
        x=x.detach() if column else cut(x.detach(), -1), weight=cut(lin.weight.detach(), 0 if column else 1),
        bias=(cut(lin.bias.detach(), 0) if column else lin.bias.detach()) if bias else None,
        up=cut(up, -1) if column else up, out=cut(y, -1) if column else y,
        grads=[x.grad if column else cut(x.grad, -1), cut(lin.weight.grad, 0 if column else 1),
               (cut(lin.bias.grad, 0) if column else lin.bias.grad) if bias else None],
        colls=(cost.column_parallel_collectives if column else cost.row_parallel_collectives)(
            x.numel() // d_in, d_in, d_out, t, elem_bytes=x.element_size()) if t > 1 else [])


def linear_answer(fn, name, case, r, t, group):
    d = _linear_data(name, case, r, t)
    xin, w = _dev(d["x"], grad=True), _dev(d["weight"], grad=True)
    b = _dev(d["bias"], grad=True) if d["bias"] is not None else None
    call = _call(fn, (xin, w, b, group), _dev(d["up"]), {"x": xin, "weight": w, "bias": b})
    return {**call, "grads": [xin.grad, w.grad, b.grad if b is not None else None]}


def linear_verdict(name, case, r, t, answer):
    d = _linear_data(name, case, r, t)
    originals = {n: d[n] for n in ("x", "weight", "bias") if d[n] is not None}
    errs = [_untouched(answer, originals), _err("the output", answer["out"], d["out"])]
    errs += [_err(f"{n}.grad", got, want) for n, got, want in zip(("x", "weight", "bias"), answer["grads"], d["grads"])
             if want is not None]
    return _with_traffic(errs, t, [answer], {p: _expected(d["colls"], p) for p in ("forward", "backward")})


# ----------------------------------------------------------------------------- modules used twice
def _two_calls(fn, args, names, up) -> list:
    """``fn`` twice on the same module(s) (gradients cleared between), as two training steps would:
    hooks registered on every call pile up, state kept from the first call shows in the second."""
    modules = [a for a in args if isinstance(a, nn.Module)]
    calls = []
    for _ in range(2):
        for q in (q for m in modules for q in m.parameters()):
            q.grad = None
        xin = _dev(args[0], grad=True)
        held = {"x": xin, **{f"{n}.{p}": q for n, m in zip(names[1:], modules) for p, q in m.named_parameters()}}
        call = _call(fn, (xin, *args[1:]), _dev(up), held)
        calls.append({**call, "x_grad": xin.grad, "grads": [[q.grad for q in m.parameters()] for m in modules]})
    return calls


def _per_call(calls, check) -> list:
    errs = []
    for i, call in enumerate(calls):
        found = check(call)
        errs += found if i == 0 else [e and f"{e} (second call on the same module)" for e in found]
    return errs


def _originals(names, modules) -> dict:
    return {f"{n}.{p}": q.detach() for n, m in zip(names, modules) for p, q in m.named_parameters()}


ATTN_DIMS = {"q.weight": 0, "q.bias": 0, "k.weight": 0, "k.bias": 0, "v.weight": 0, "v.bias": 0, "o.weight": 1}
MLP_DIMS = {"fc.weight": 0, "fc.bias": 0, "proj.weight": 1}


def _sharded_grads(ref: nn.Module, grads: list, r, t, dims: dict) -> list:
    """Each parameter's gradient on this rank: its chunk along dims[name] (None: replicated, whole)."""
    errs = []
    for (pname, p_ref), got in zip(ref.named_parameters(), grads):
        dim = dims.get(pname)
        errs.append(_err(f"{pname}.grad", got, p_ref.grad if dim is None else _masked(p_ref.grad, dim, r, t)))
    return errs


def _module_data(name, case):
    cfg = dataclasses.replace(CFG, **case.get("cfg", {}))
    dtype = case.get("dtype", torch.float32)
    block = TinyGPT(cfg, device="cpu").blocks[0].to(dtype)
    ref = block.mlp if name == "tp_mlp" else block.attn
    return cfg, ref, _randn((B, S, cfg.d_model), 8, dtype).requires_grad_(), _randn((B, S, cfg.d_model), 9, dtype)


def _heads_split(cfg, t) -> bool:
    return not (cfg.n_heads % t or cfg.n_kv_heads % t)


def module_answer(fn, name, case, r, t, group):
    cfg, ref, x, up = _module_data(name, case)
    mine = copy.deepcopy(ref).to(rank_device())
    if case.get("raises") and not _heads_split(cfg, t):
        return attempt(fn, (_dev(x, grad=True), mine, group))
    return {"calls": _two_calls(fn, (x.detach(), mine, group), ("x", name.split("_")[1]), up)}


def module_verdict(name, case, r, t, answer):
    cfg, ref, x, up = _module_data(name, case)
    if case.get("raises") and not _heads_split(cfg, t):
        return raise_verdict(answer, f"{cfg.n_heads} query and {cfg.n_kv_heads} key/value heads do not both split "
                             f"over t = {t} (attention is split by whole heads)")
    originals = {"x": x.detach(), **_originals((name.split("_")[1],), (ref,))}
    (ref(x) * up).sum().backward()
    y, dims = ref(x).detach(), MLP_DIMS if name == "tp_mlp" else ATTN_DIMS
    errs = _per_call(answer["calls"], lambda call: [
        _untouched(call, originals), _err("the output", call["out"], y), _err("x.grad", call["x_grad"], x.grad),
        *_sharded_grads(ref, call["grads"][0], r, t, dims)])
    colls = cost.tp_layer_collectives(B, S, cfg.d_model, t, sublayers=1, elem_bytes=x.element_size()) if t > 1 else []
    return _with_traffic(errs, t, answer["calls"], {p: _expected(colls, p) for p in ("forward", "backward")})


def _sp_block_data(case):
    dtype = case.get("dtype", torch.float32)
    block = TinyGPT(CFG, device="cpu").blocks[0].to(dtype)
    return block.ln_2, block.mlp, _randn((B, S, CFG.d_model), 31, dtype), _randn((B, S, CFG.d_model), 32, dtype)


def sp_block_answer(fn, name, case, r, t, group):
    ln, mlp, x, up = _sp_block_data(case)
    ln_s, mlp_s = copy.deepcopy(ln).to(rank_device()), copy.deepcopy(mlp).to(rank_device())
    return {"calls": _two_calls(fn, (_part(x, SEQ, r, t), ln_s, mlp_s, group), ("x", "ln", "mlp"), _part(up, SEQ, r, t))}


def sp_block_verdict(name, case, r, t, answer):
    ln, mlp, x, up = _sp_block_data(case)
    originals = {"x": _part(x, SEQ, r, t), **_originals(("ln", "mlp"), (ln, mlp))}
    x = x.requires_grad_()
    y = x + mlp(ln(x))
    (y * up).sum().backward()
    errs = _per_call(answer["calls"], lambda call: (
        [_untouched(call, originals), _err("the output", call["out"], _part(y.detach(), SEQ, r, t)),
         _err("x.grad", call["x_grad"], _part(x.grad, SEQ, r, t))]
        + [_err(f"ln.{n}.grad", got, p.grad) for (n, p), got in zip(ln.named_parameters(), call["grads"][0])]
        + [f"mlp.{e}" if e else None for e in _sharded_grads(mlp, call["grads"][1], r, t, MLP_DIMS)]))
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
    return _with_traffic(errs, t, answer["calls"], want, sums_partial_grads)


# ----------------------------------------------------------------------------- vocab-parallel cross entropy
def _ce_data(case, t):
    vocab, ignore, lead = case["vocab"], case["ignore_index"], case["lead"]
    logits = case["scale"] * _randn((*lead, vocab), 11, case.get("dtype", torch.float32))
    target = torch.randint(0, vocab, lead, generator=torch.Generator().manual_seed(12), device="cpu").flatten()
    bounds = sorted({b for rr in range(t) for b in shard_range(vocab, rr, t)} - {vocab})
    target[:len(bounds)] = torch.tensor(bounds, device="cpu")              # first id of every shard
    target[len(bounds):2 * len(bounds)] = torch.tensor([b - 1 for b in bounds[1:]] + [vocab - 1], device="cpu")  # last
    target[2 * len(bounds)::5] = ignore
    return logits, target.view(lead)


def ce_answer(fn, name, case, r, t, group):
    logits, target = _ce_data(case, t)
    a, b = shard_range(case["vocab"], r, t)
    mine, target_here = _dev(logits[..., a:b], grad=True), _dev(target)
    kwargs = {"vocab_size": case["vocab"]} if case["uneven"] else {}
    call = _call(fn, (mine, target_here, group, case["ignore_index"]), None,
                 {"logits": mine, "target": target_here}, kwargs)
    return {**call, "grad": mine.grad}


def ce_verdict(name, case, r, t, answer):
    logits, target = _ce_data(case, t)
    a, b = shard_range(case["vocab"], r, t)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, -2), target.flatten(), ignore_index=case["ignore_index"])
    ref.backward()
    errs = [_untouched(answer, {"logits": logits[..., a:b], "target": target}), _err("the loss", answer["out"], ref.detach()),
            _err("logits.grad", answer["grad"], full.grad[..., a:b])]
    tokens, e = target.numel(), logits.element_size()
    want = {p: _expected(cost.vocab_parallel_ce_collectives(tokens, t, e) if t > 1 else [], p)
            for p in ("forward", "backward")}
    got = {p: counted(answer[p]) for p in ("forward", "backward")}
    # the target logit and the sum of exp may share one all-reduce
    if got["forward"] == Counter({("all-reduce", e * tokens): 1, ("all-reduce", 2 * e * tokens): 1}):
        got["forward"] = want["forward"]
    return _with_traffic(errs, t, [got], want)


RUNNERS = {"copy_to_tp": (f_g_answer, f_g_verdict), "reduce_from_tp": (f_g_answer, f_g_verdict),
           "column_parallel_linear": (linear_answer, linear_verdict), "row_parallel_linear": (linear_answer, linear_verdict),
           "tp_mlp": (module_answer, module_verdict), "tp_attention": (module_answer, module_verdict),
           "vocab_parallel_cross_entropy": (ce_answer, ce_verdict),
           "sp_gather": (sp_answer, sp_verdict), "sp_reduce_scatter": (sp_answer, sp_verdict),
           "sp_mlp_block": (sp_block_answer, sp_block_verdict)}


def _runner(name: str, answer, verdict) -> RankRunner:
    return RankRunner(lambda fn, case, r, t, group: answer(fn, name, case, r, t, group),
                      lambda case, r, t, got: verdict(name, case, r, t, got))


CASE_RUNNERS = {name: _runner(name, *pair) for name, pair in RUNNERS.items()}
