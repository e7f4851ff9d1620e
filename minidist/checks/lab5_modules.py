"""Lab 5's cases for the modules: ``tp_mlp`` and ``tp_attention`` (Shoeybi et al. 2019, Megatron-LM,
Sec. 3: one f before the column-parallel half, one g after the row-parallel half) and
``sp_mlp_block`` (Korthikanti et al. 2022, Sec. 4.2.2: LayerNorm on the sequence shard, g and ḡ as
an all-gather and a reduce-scatter, the replicated parameters' partial gradients all-reduced).

Each module is used for two calls in a row, as two training steps would use it: hooks that pile
up, or state kept from the first call, show in the second. The answers and verdicts follow
:mod:`minidist.checks.lab5_cases`; the expected traffic is
:func:`minidist.cost.tp_layer_collectives`.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch
import torch.nn as nn

from minidist import cost
from minidist.checks.kit.groups import attempt, raise_verdict
from minidist.checks.lab5_data import (B, CFG, S, SEQ, _call, _dev, _err, _expected, _masked, _part, _randn, _untouched,
                                       _with_traffic)
from minidist.models import TinyGPT
from minidist.runtime.device import device as rank_device


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
