"""Lab 5's verdicts: one rank's answer against the single-process module, and its traced collectives
against the cost model. Each verdict rebuilds the inputs and the reference from the case's seeds
(:mod:`.cases`), so the grader's judge gives it again from the answer alone.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3) give each function's values and its f/g traffic;
Korthikanti et al. 2022 (Sec. 4.2.2) the sequence-parallel all-gathers and reduce-scatters;
:mod:`minidist.cost.tensor_parallel` the bytes. Values first (the kit's one comparison, with lab 5's
tolerance, and the wrong-group hint for a sum over the world), the caller's tensors unchanged after
forward and after backward, then (t > 1) each phase's (kind, payload bytes) in any order.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from minidist import cost
from minidist.checks.kit.compare import FAMILY, counted, first, seeded, tensor_error, traffic_problem, untouched
from minidist.checks.kit.groups import wrong_group_hint
from minidist.checks.kit.raises import raise_verdict
from minidist.checks.lab5_tensor_parallel.cases import (B, CFG, S, SEQ, TOL, WORLD, ce_inputs, f_g_inputs, heads_split,
                                                        linear_cuts, linear_layer, module_inputs, part, sp_block_inputs,
                                                        sp_inputs)
from minidist.tensor_parallel.comm import shard_range

PHASES = ("forward", "backward")


# ----------------------------------------------------------------------------- values
def compared(what: str, got, want: torch.Tensor, t: int | None = None) -> str | None:
    """The kit's comparison with one process, at lab 5's tolerance (:data:`.cases.TOL`); with the
    group's size ``t``, a constant factor of t (f or g summing or averaging once too often) is named."""
    factors = {"t, the tensor-parallel group's size": t} if t else None
    return tensor_error(what, got, want, tol=TOL, against="one process", factors=factors)


def hinted(problem, got, want, world, t):
    """``problem`` with the wrong-group diagnosis added when ``got`` is the sum over the world's ranks."""
    hint = problem and wrong_group_hint(got, want, world, t, WORLD)
    return f"{problem}.{hint}" if hint else problem


def world_sum(shape, base, dtype, t):
    """What a sum over every rank of the world gives (a collective without group=): world rank w
    is rank w % t of its group, so it drew its data from seed ``base + w % t``."""
    return sum(seeded(shape, base + w % t, dtype) for w in range(WORLD))


def masked(full, dim, r, t):
    """The gradient rank r's slice of a replicated parameter gets: its chunk, zeros elsewhere."""
    out = torch.zeros_like(full)
    a, b = shard_range(full.shape[dim], r, t)
    out.narrow(dim, a, b - a).copy_(full.narrow(dim, a, b - a))
    return out


def held_unchanged(answer: dict, originals: dict) -> str | None:
    """The caller's tensors ({name: as they went in}) unchanged after the forward, then after the backward."""
    return (untouched(answer["held"][0], originals, "the forward")
            or untouched(answer["held"][1], originals, "the backward"))


# ----------------------------------------------------------------------------- traffic
def expected(colls, phase) -> Counter:
    """The cost model's collectives of one phase, as (kind, payload bytes)."""
    return Counter((FAMILY[c.op], c.nbytes) for c in colls if c.phase == phase)


def compare_traffic(got: dict, want: dict, extra=None) -> str | None:
    """``got``/``want``: {phase: record or Counter}. ``extra(phase, leftover) -> bool`` may accept what is
    left over (nothing may be missing)."""
    for phase in PHASES:
        accept = None if extra is None else (lambda g, w, phase=phase: not (w - g) and extra(phase, g - w))
        if problem := traffic_problem(phase, got[phase], want.get(phase, Counter()), accept):
            return problem
    return None


def with_traffic(errs: list, t: int, calls: list, want: dict, extra=None) -> str | None:
    """The first problem, then (when there is none, for t > 1) what a call's traffic got wrong."""
    if (problem := first(errs)) or t == 1:
        return problem
    for i, done in enumerate(calls):
        problem = compare_traffic({p: done[p] for p in PHASES}, want, extra)
        if problem:
            return problem + (" (second call on the same module)" if i else "")
    return None


# ----------------------------------------------------------------------------- f and g, SP's pair
def f_g(item, answer) -> str | None:
    case, r, t, name = item.case, item.r, item.t, item.function
    d = f_g_inputs(name, case, t)
    world = world_sum(case["shape"], d["base"], case["dtype"], t)
    if name == "copy_to_tp":
        x, total = d["x"], sum(d["ups"])
        errs = [held_unchanged(answer, {"x": x}), compared("the output", answer["out"], x, t),
                hinted(compared("x.grad", answer["grad"], total, t), answer["grad"], total, world, t)]
        want = {"backward": Counter({("all-reduce", x.numel() * x.element_size()): 1})}
    else:
        total, up = sum(d["xs"]), d["up"]
        errs = [held_unchanged(answer, {"x": d["xs"][r]}),
                hinted(compared("the output", answer["out"], total, t), answer["out"], total, world, t),
                compared("x.grad", answer["grad"], up, t)]
        want = {"forward": Counter({("all-reduce", up.numel() * up.element_size()): 1})}
    return with_traffic(errs, t, [answer], want)


def sp(item, answer) -> str | None:
    case, r, t, name = item.case, item.r, item.t, item.function
    d = sp_inputs(name, case, t)
    full = d["full"]
    shard_bytes, full_bytes = full.nbytes // t, full.nbytes
    if name == "sp_gather":
        errs = [held_unchanged(answer, {"x": part(full, SEQ, r, t)}), compared("the output", answer["out"], full, t),
                compared("x.grad", answer["grad"], part(sum(d["ups"]), SEQ, r, t), t)]
        want = {"forward": Counter({("all-gather", shard_bytes): 1}),
                "backward": Counter({("reduce-scatter", full_bytes): 1})}
    else:
        errs = [held_unchanged(answer, {"x": d["xs"][r]}),
                compared("the output", answer["out"], part(sum(d["xs"]), SEQ, r, t), t),
                compared("x.grad", answer["grad"], d["up"], t)]
        want = {"forward": Counter({("reduce-scatter", full_bytes): 1}),
                "backward": Counter({("all-gather", shard_bytes): 1})}
    return with_traffic(errs, t, [answer], want)


# ----------------------------------------------------------------------------- linear layers, the loss
def linear(item, answer) -> str | None:
    case, r, t, name = item.case, item.r, item.t, item.function
    lin, x, up = linear_layer(case)
    cut = linear_cuts(name, r, t)
    originals = {n: cut[n](v.detach()) for n, v in (("x", x), ("weight", lin.weight), ("bias", lin.bias))
                 if v is not None}
    y = lin(x.requires_grad_())
    (y * up).sum().backward()
    errs = [held_unchanged(answer, originals), compared("the output", answer["out"], cut["out"](y.detach()))]
    wants = [cut["x"](x.grad), cut["weight"](lin.weight.grad), cut["bias"](lin.bias.grad) if case["bias"] else None]
    errs += [compared(f"{n}.grad", got, want) for n, got, want in zip(("x", "weight", "bias"), answer["grads"], wants)
             if want is not None]
    colls = (cost.column_parallel_collectives if name == "column_parallel_linear" else cost.row_parallel_collectives)(
        x.numel() // case["d_in"], case["d_in"], case["d_out"], t, elem_bytes=x.element_size()) if t > 1 else []
    return with_traffic(errs, t, [answer], {p: expected(colls, p) for p in PHASES})


def cross_entropy(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    logits, target = ce_inputs(case, t)
    a, b = shard_range(case["vocab"], r, t)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, -2), target.flatten(), ignore_index=case["ignore_index"])
    ref.backward()
    errs = [held_unchanged(answer, {"logits": logits[..., a:b], "target": target}),
            compared("the loss", answer["out"], ref.detach()),
            compared("logits.grad", answer["grad"], full.grad[..., a:b])]
    tokens, e = target.numel(), logits.element_size()
    want = {p: expected(cost.vocab_parallel_ce_collectives(tokens, t, e) if t > 1 else [], p) for p in PHASES}
    got = {p: counted(answer[p]) for p in PHASES}
    # the target logit and the sum of exp may share one all-reduce
    if got["forward"] == Counter({("all-reduce", e * tokens): 1, ("all-reduce", 2 * e * tokens): 1}):
        got["forward"] = want["forward"]
    return with_traffic(errs, t, [got], want)


# ----------------------------------------------------------------------------- modules, used twice in a row
ATTN_DIMS = {"q.weight": 0, "q.bias": 0, "k.weight": 0, "k.bias": 0, "v.weight": 0, "v.bias": 0, "o.weight": 1}
MLP_DIMS = {"fc.weight": 0, "fc.bias": 0, "proj.weight": 1}


def per_call(calls, check) -> list:
    """``check(call)``'s problems for each call; the second call's say so."""
    errs = []
    for i, done in enumerate(calls):
        found = check(done)
        errs += found if i == 0 else [e and f"{e} (second call on the same module)" for e in found]
    return errs


def originals(names, modules) -> dict:
    return {f"{n}.{p}": q.detach() for n, m in zip(names, modules) for p, q in m.named_parameters()}


def sharded_grads(ref: nn.Module, grads: list, r, t, dims: dict) -> list:
    """Each parameter's gradient on this rank: its chunk along dims[name] (None: replicated, whole)."""
    this_rank = lambda name, g: g if dims.get(name) is None else masked(g, dims[name], r, t)     # noqa: E731
    return [compared(f"{pname}.grad", got, this_rank(pname, p_ref.grad))
            for (pname, p_ref), got in zip(ref.named_parameters(), grads)]


def module(item, answer) -> str | None:
    """``tp_mlp`` / ``tp_attention``: one f before the column-parallel half, one g after the row-parallel
    half (Megatron-LM, Sec. 3), on both calls; a ValueError before any message where heads do not split."""
    case, r, t, name = item.case, item.r, item.t, item.function
    cfg, ref, x, up = module_inputs(name, case)
    if case.get("raises") and not heads_split(cfg, t):
        return raise_verdict(answer, f"{cfg.n_heads} query and {cfg.n_kv_heads} key/value heads do not both split "
                             f"over t = {t} (attention is split by whole heads)")
    held = {"x": x.detach(), **originals((name.split("_")[1],), (ref,))}
    (ref(x) * up).sum().backward()
    y, dims = ref(x).detach(), MLP_DIMS if name == "tp_mlp" else ATTN_DIMS
    errs = per_call(answer["calls"], lambda done: [
        held_unchanged(done, held), compared("the output", done["out"], y), compared("x.grad", done["x_grad"], x.grad),
        *sharded_grads(ref, done["grads"][0], r, t, dims)])
    colls = cost.tp_layer_collectives(B, S, cfg.d_model, t, sublayers=1, elem_bytes=x.element_size()) if t > 1 else []
    return with_traffic(errs, t, answer["calls"], {p: expected(colls, p) for p in PHASES})


def sp_block(item, answer) -> str | None:
    """``sp_mlp_block`` (Korthikanti et al. 2022, Sec. 4.2.2): LayerNorm on the sequence shard, g and ḡ
    as an all-gather and a reduce-scatter, the replicated parameters' partial gradients all-reduced."""
    case, r, t = item.case, item.r, item.t
    ln, mlp, x, up = sp_block_inputs(case)
    held = {"x": part(x, SEQ, r, t), **originals(("ln", "mlp"), (ln, mlp))}
    x = x.requires_grad_()
    y = x + mlp(ln(x))
    (y * up).sum().backward()
    errs = per_call(answer["calls"], lambda done: (
        [held_unchanged(done, held), compared("the output", done["out"], part(y.detach(), SEQ, r, t)),
         compared("x.grad", done["x_grad"], part(x.grad, SEQ, r, t))]
        + [compared(f"ln.{n}.grad", got, p.grad) for (n, p), got in zip(ln.named_parameters(), done["grads"][0])]
        + [f"mlp.{e}" if e else None for e in sharded_grads(mlp, done["grads"][1], r, t, MLP_DIMS)]))
    e = x.element_size()
    colls = cost.tp_layer_collectives(B, S, CFG.d_model, t, sequence_parallel=True, sublayers=1,
                                      elem_bytes=e) if t > 1 else []
    want = {p: expected(colls, p) for p in PHASES}
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
    return with_traffic(errs, t, answer["calls"], want, sums_partial_grads)


#: per graded function: verdict(RankCase, answer), the function's name in ``RankCase.function``
VERDICT = {"copy_to_tp": f_g, "reduce_from_tp": f_g, "column_parallel_linear": linear, "row_parallel_linear": linear,
           "tp_mlp": module, "tp_attention": module, "vocab_parallel_cross_entropy": cross_entropy,
           "sp_gather": sp, "sp_reduce_scatter": sp, "sp_mlp_block": sp_block}
