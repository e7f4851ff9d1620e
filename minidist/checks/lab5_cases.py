"""Lab 5's cases, one runner per kind of graded function: a forward and a backward on this rank
against the single-process module, and the collectives it traced against the cost model.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3) give each function's values and its f/g traffic;
Korthikanti et al. 2022 (Sec. 4.2.2) the sequence-parallel all-gathers and reduce-scatters;
:mod:`minidist.cost.tensor_parallel` the bytes. A runner is judged
(:class:`minidist.checks.kit.groups.RankRunner`): its ``answer`` runs the student's function on group
rank r of t and returns what it did as plain data (outputs, gradients, digests of the caller's
tensors after each phase, the traffic of each phase); its ``verdict`` rebuilds the inputs and the
reference from seeds (:mod:`minidist.checks.lab5_data`) and lists the problems, so the grader's
judge gives it again. Every case proves the caller's tensors (arguments, a module's weights)
unchanged and the output in the input's dtype. Group rank s draws its own data from seed
``base + s``. The modules' runners (used twice in a row) are in :mod:`minidist.checks.lab5_modules`.
Used by :mod:`minidist.checks.lab5_tensor_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from minidist import cost
from minidist.checks.kit.groups import RankRunner
from minidist.checks.lab5_data import (B, CFG, S, SEQ, _call, _dev, _err, _expected, _hinted, _part, _randn, _untouched,
                                       _with_traffic, _world, counted)
from minidist.checks.lab5_modules import module_answer, module_verdict, sp_block_answer, sp_block_verdict
from minidist.tensor_parallel.comm import shard_range


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
def _linear_layer(case):
    """The single-process layer, its input and the upstream gradient of its output (seeds 3, 4, 5)."""
    d_in, d_out, dtype = case["d_in"], case["d_out"], case["dtype"]
    torch.manual_seed(3)
    lin = nn.Linear(d_in, d_out, bias=case["bias"], dtype=dtype, device="cpu")
    return lin, _randn((*case["lead"], d_in), 4, dtype), _randn((*case["lead"], d_out), 5, dtype)


def _linear_cuts(name, r, t) -> dict:
    """Rank r's piece of each tensor: column-parallel splits the weight's rows (and the bias, the
    output); row-parallel the weight's columns (and the input)."""
    column, whole = name == "column_parallel_linear", (lambda v: v)
    last = lambda v: _part(v, -1, r, t)                         # noqa: E731
    return {"x": whole if column else last, "out": last if column else whole,
            "weight": lambda v: _part(v, 0 if column else 1, r, t),
            "bias": (lambda v: _part(v, 0, r, t)) if column else whole}


def linear_answer(fn, name, case, r, t, group):
    lin, x, up = _linear_layer(case)
    cut = _linear_cuts(name, r, t)
    xin, w = _dev(cut["x"](x), grad=True), _dev(cut["weight"](lin.weight.detach()), grad=True)
    b = _dev(cut["bias"](lin.bias.detach()), grad=True) if case["bias"] else None
    call = _call(fn, (xin, w, b, group), _dev(cut["out"](up)), {"x": xin, "weight": w, "bias": b})
    return {**call, "grads": [xin.grad, w.grad, b.grad if b is not None else None]}


def linear_verdict(name, case, r, t, answer):
    lin, x, up = _linear_layer(case)
    cut = _linear_cuts(name, r, t)
    originals = {n: cut[n](v.detach()) for n, v in (("x", x), ("weight", lin.weight), ("bias", lin.bias))
                 if v is not None}
    y = lin(x.requires_grad_())
    (y * up).sum().backward()
    errs = [_untouched(answer, originals), _err("the output", answer["out"], cut["out"](y.detach()))]
    wants = [cut["x"](x.grad), cut["weight"](lin.weight.grad), cut["bias"](lin.bias.grad) if case["bias"] else None]
    errs += [_err(f"{n}.grad", got, want) for n, got, want in zip(("x", "weight", "bias"), answer["grads"], wants)
             if want is not None]
    colls = (cost.column_parallel_collectives if name == "column_parallel_linear" else cost.row_parallel_collectives)(
        x.numel() // case["d_in"], case["d_in"], case["d_out"], t, elem_bytes=x.element_size()) if t > 1 else []
    return _with_traffic(errs, t, [answer], {p: _expected(colls, p) for p in ("forward", "backward")})


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
