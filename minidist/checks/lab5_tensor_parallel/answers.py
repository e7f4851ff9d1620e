"""Lab 5's answers: what the student's function did on this rank (rank ``on.r`` of a group of
``on.t``), as plain data. The only file of lab 5's checks that calls student code.

Every answer runs a forward, then a backward of sum(out * upstream), each under the tracer, and
records the output, the gradients, each phase's traffic and digests of the caller's tensors after
each phase (:func:`call`). Modules (``tp_mlp``, ``tp_attention``, ``sp_mlp_block``) are called twice
in a row, as two training steps would call them (:func:`two_calls`).
"""
from __future__ import annotations

import copy

import torch.nn as nn

from minidist.checks.kit.compare import digest, on_rank, traffic
from minidist.checks.kit.raises import attempt
from minidist.checks.lab5_tensor_parallel.cases import (SEQ, ce_inputs, f_g_inputs, heads_split, linear_cuts,
                                                        linear_layer, module_inputs, part, sp_block_inputs, sp_inputs)
from minidist.runtime.device import device as rank_device
from minidist.tensor_parallel.comm import shard_range
from minidist.trace import trace


def call(fn, args, upstream, held: dict, kwargs=None) -> dict:
    """Forward, then backward of sum(out * upstream) (or out.backward()), each under the tracer: the
    output, each phase's traffic, and digests of the caller's tensors ``held`` after each phase."""
    with trace() as tf:
        out = fn(*args, **(kwargs or {}))
    after_forward = {n: digest(x) for n, x in held.items() if x is not None}
    with trace() as tb:
        (out * upstream).sum().backward() if upstream is not None else out.backward()
    return {"out": out, "forward": traffic(tf), "backward": traffic(tb),
            "held": [after_forward, {n: digest(x) for n, x in held.items() if x is not None}]}


def f_g(name, fn, case, on) -> dict:
    """f (``copy_to_tp``) on the replicated input, g (``reduce_from_tp``) on this rank's own; the
    input is a non-leaf (the graded function's backward must reach the leaf)."""
    d = f_g_inputs(name, case, on.t)
    leaf = on_rank(d["x"] if name == "copy_to_tp" else d["xs"][on.r], grad=True)
    given = leaf * 1
    upstream = on_rank(d["ups"][on.r] if name == "copy_to_tp" else d["up"])
    return {**call(fn, (given, on.group), upstream, {"x": given}), "grad": leaf.grad}


def sp(name, fn, case, on) -> dict:
    """``sp_gather`` on this rank's sequence shard, ``sp_reduce_scatter`` on its own partial sum."""
    d = sp_inputs(name, case, on.t)
    gather = name == "sp_gather"
    leaf = on_rank(part(d["full"], SEQ, on.r, on.t) if gather else d["xs"][on.r], grad=True)
    given = leaf * 1
    upstream = on_rank(d["ups"][on.r] if gather else part(d["up"], SEQ, on.r, on.t))
    return {**call(fn, (given, on.group), upstream, {"x": given}), "grad": leaf.grad}


def linear(name, fn, case, on) -> dict:
    """A column- or row-parallel layer on this rank's pieces of the input, weight and bias."""
    lin, x, up = linear_layer(case)
    cut = linear_cuts(name, on.r, on.t)
    xin, w = on_rank(cut["x"](x), grad=True), on_rank(cut["weight"](lin.weight.detach()), grad=True)
    b = on_rank(cut["bias"](lin.bias.detach()), grad=True) if case["bias"] else None
    done = call(fn, (xin, w, b, on.group), on_rank(cut["out"](up)), {"x": xin, "weight": w, "bias": b})
    return {**done, "grads": [xin.grad, w.grad, b.grad if b is not None else None]}


def cross_entropy(name, fn, case, on) -> dict:
    """The loss on this rank's vocabulary shard (``vocab_size=`` given when the shards are uneven)."""
    logits, target = ce_inputs(case, on.t)
    a, b = shard_range(case["vocab"], on.r, on.t)
    mine, target_here = on_rank(logits[..., a:b], grad=True), on_rank(target)
    kwargs = {"vocab_size": case["vocab"]} if case["uneven"] else {}
    done = call(fn, (mine, target_here, on.group, case["ignore_index"]), None,
                {"logits": mine, "target": target_here}, kwargs)
    return {**done, "grad": mine.grad}


def two_calls(fn, args, names, up) -> list:
    """``fn`` twice on the same module(s) (gradients cleared between), as two training steps would:
    hooks registered on every call pile up, state kept from the first call shows in the second."""
    modules = [a for a in args if isinstance(a, nn.Module)]
    calls = []
    for _ in range(2):
        for q in (q for m in modules for q in m.parameters()):
            q.grad = None
        xin = on_rank(args[0], grad=True)
        held = {"x": xin, **{f"{n}.{p}": q for n, m in zip(names[1:], modules) for p, q in m.named_parameters()}}
        done = call(fn, (xin, *args[1:]), on_rank(up), held)
        calls.append({**done, "x_grad": xin.grad, "grads": [[q.grad for q in m.parameters()] for m in modules]})
    return calls


def module(name, fn, case, on) -> dict:
    """``tp_mlp`` / ``tp_attention`` on the full module (each rank uses its chunk), twice; where the
    heads do not split over t, the call that must raise ValueError before any message."""
    cfg, ref, x, up = module_inputs(name, case)
    mine = copy.deepcopy(ref).to(rank_device())
    if case.get("raises") and not heads_split(cfg, on.t):
        return attempt(fn, (on_rank(x, grad=True), mine, on.group))
    return {"calls": two_calls(fn, (x.detach(), mine, on.group), ("x", name.split("_")[1]), up)}


def sp_block(name, fn, case, on) -> dict:
    """``sp_mlp_block`` on this rank's sequence shard, LayerNorm and MLP whole on every rank, twice."""
    ln, mlp, x, up = sp_block_inputs(case)
    ln_s, mlp_s = copy.deepcopy(ln).to(rank_device()), copy.deepcopy(mlp).to(rank_device())
    return {"calls": two_calls(fn, (part(x, SEQ, on.r, on.t), ln_s, mlp_s, on.group), ("x", "ln", "mlp"),
                               part(up, SEQ, on.r, on.t))}


#: per graded function: answer(name, fn, case, on)
ANSWER = {"copy_to_tp": f_g, "reduce_from_tp": f_g, "column_parallel_linear": linear, "row_parallel_linear": linear,
          "tp_mlp": module, "tp_attention": module, "vocab_parallel_cross_entropy": cross_entropy,
          "sp_gather": sp, "sp_reduce_scatter": sp, "sp_mlp_block": sp_block}
