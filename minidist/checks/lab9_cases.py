"""Lab 9's cases, one runner per distributed graded function: this rank's results against the same
Mixture-of-Experts computed in one process, and the all-to-alls it traced against the cost model.

Lepikhin et al. 2020 (GShard, Sec. 2: dispatch and combine by all-to-all), Fedus et al. 2021
(Switch, Sec. 2: capacity). A runner is judged (:class:`minidist.checks.kit.groups.RankRunner`): its
``answer(fn, case, r, t, group)`` runs the student's function on group rank r of t and returns
what it did as plain data; its ``verdict(case, r, t, answer)`` lists the problems, and runs no
student code, so the grader's judge gives it again. Every case is drawn from seeds
(:mod:`minidist.checks.lab9_data`), so one process rebuilds the expected rows, routes and
gradients of a whole group (:func:`minidist.checks.lab9_reference.plan`); references run on the
CPU in the case's dtype, the student's code on ``minidist.device()``. Used by
:mod:`minidist.checks.lab9_expert_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

import copy
import functools

import torch

from minidist.checks import lab9_reference as ref
from minidist.checks.kit.docket import digest
from minidist.checks.kit.groups import RankRunner, attempt, first_problem, raise_verdict
from minidist.checks.lab9_data import (AUX, CPU, HID, choices, compare, err, expected, make_experts, on_rank, randn,
                                       tokens_of, traffic, unchanged)
from minidist.trace import trace


# ----------------------------------------------------------------------------- one runner per function
# Each graded function has an answer (run in the rank: the student's code, its results, the
# traffic it traced) and a verdict (the reference, rebuilt from the case alone). A rank runs the
# backward pass only where the forward pass passed here, as every rank of a correct solution does.
NO_BACKWARD = "the backward pass did not run"


def forward_passed(verdict, case, r, t, answer) -> bool:
    """Whether the forward half of ``answer`` passes (the rank then runs the backward pass)."""
    return first_problem(verdict(case, r, t, answer)) == NO_BACKWARD


def _dispatch_inputs(case, t):
    toks = [randn((tokens_of(s), HID), 10 + s, case["dtype"]) for s in range(t)]
    if case.get("raises"):
        return toks, None, None
    picks = [choices(case, s, t) for s in range(t)]
    return toks, picks, ref.plan(picks, case["E"])


def _dispatch_raise(case, r, t):
    idx = torch.zeros(tokens_of(r) + (case["raises"] == "rows"), case["k"], dtype=torch.long, device=CPU)
    what = (f"{case['E']} experts do not split over {t} ranks" if case["raises"] == "split"
            else "expert_indices has a row more than there are tokens")
    return idx, what


def dispatch_answer(fn, case, r, t, group):
    toks, picks, p = _dispatch_inputs(case, t)
    if case.get("raises"):
        return attempt(fn, (on_rank(toks[r]), on_rank(_dispatch_raise(case, r, t)[0]), case["E"], group))
    x = on_rank(toks[r]).requires_grad_()
    given, idx = x * 1, on_rank(picks[r])
    with trace() as tf:
        result = fn(given, idx, case["E"], group)
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    answer = {"rows": result[0] if ok else None, "shape": ok, "idx": digest(idx), "given": digest(given),
              "forward": traffic(tf), "route": {f: getattr(result[1], f, None) for f in ref.Route._fields} if ok else None}
    if not forward_passed(dispatch_verdict, case, r, t, answer):
        return answer
    ups = [randn((len(p.src[d]), HID), 20 + d, case["dtype"]) for d in range(t)]
    with trace() as tb:
        (result[0] * on_rank(ups[r])).sum().backward()
    return {**answer, "grad": x.grad, "backward": traffic(tb)}


def dispatch_verdict(case, r, t, answer):
    if case.get("raises"):
        return raise_verdict(answer, _dispatch_raise(case, r, t)[1])
    if not answer["shape"]:
        return ["ep_dispatch must return (expert_inputs, route)"]
    toks, picks, p = _dispatch_inputs(case, t)
    k = case["k"]
    want_rows = torch.stack([toks[s][q // k] for s, q in zip(p.src[r].tolist(), p.pair[r].tolist())]) \
        if len(p.src[r]) else toks[r].new_zeros(0, HID)
    errs = [err("expert_inputs", answer["rows"], want_rows), unchanged("expert_indices", answer["idx"], picks[r]),
            unchanged("tokens", answer["given"], toks[r])]
    want_route = p.routes[r]
    for field in ref.Route._fields:
        got = answer["route"][field]
        if isinstance(got, torch.Tensor) and field == "recv_counts":
            got = got.reshape(t, -1)
        errs.append(err(f"route.{field}", got, getattr(want_route, field)))
    if any(errs) or "backward" not in answer:
        return errs if any(errs) else [NO_BACKWARD]
    ups = [randn((len(p.src[d]), HID), 20 + d, case["dtype"]) for d in range(t)]
    want_grad = toks[r].new_zeros(tokens_of(r), HID)
    for d in range(t):
        mine = p.src[d] == r
        want_grad.index_add_(0, p.pair[d][mine] // k, ups[d][mine])
    errs.append(err("tokens.grad", answer["grad"], want_grad))
    if t > 1 and not any(errs):
        el, sent, got = toks[r].element_size(), len(want_route.order), len(p.src[r])
        errs += [compare(answer, phase, expected("ep_dispatch", sent, got, case["E"], t, el, phase))
                 for phase in ("forward", "backward")]
    return errs


def _combine_inputs(case, t):
    num_experts, k, dtype = case["E"], case["k"], case["dtype"]
    picks = [choices(case, s, t) for s in range(t)]
    p = ref.plan(picks, num_experts)
    outs = [randn((len(p.src[d]), HID), 30 + d, dtype).requires_grad_() for d in range(t)]
    ws = [randn((tokens_of(s), k), 40 + s, dtype).abs().requires_grad_() for s in range(t)]
    ups = [randn((tokens_of(s), HID), 50 + s, dtype) for s in range(t)]
    return p, outs, ws, ups


def combine_answer(fn, case, r, t, group):
    p, outs, ws, ups = _combine_inputs(case, t)
    eo, w = on_rank(outs[r].detach()).requires_grad_(), on_rank(ws[r].detach()).requires_grad_()
    route = ref.Route(*(on_rank(x) for x in p.routes[r]))
    given = (eo * 1, w * 1)
    with trace() as tf:
        y = fn(*given, route, group)
    answer = {"y": y, "given": [digest(g) for g in given], "forward": traffic(tf)}
    if not forward_passed(combine_verdict, case, r, t, answer):
        return answer
    with trace() as tb:
        (y * on_rank(ups[r])).sum().backward()
    return {**answer, "grads": (eo.grad, w.grad), "backward": traffic(tb)}


def combine_verdict(case, r, t, answer):
    p, outs, ws, ups = _combine_inputs(case, t)
    k, total = case["k"], 0
    for s in range(t):               # the reference: every rank's tokens, in one process
        y = outs[s].new_zeros(tokens_of(s), HID)
        for d in range(t):
            mine = p.src[d] == s
            pairs = p.pair[d][mine]
            y = y.index_add(0, pairs // k, outs[d][mine] * ws[s].reshape(-1)[pairs, None])
        if s == r:
            want_y = y.detach()
        total = total + (y * ups[s]).sum()
    errs = [err("the output", answer["y"], want_y), unchanged("expert_outputs", answer["given"][0], outs[r].detach()),
            unchanged("weights", answer["given"][1], ws[r].detach())]
    if any(errs) or "backward" not in answer:
        return errs if any(errs) else [NO_BACKWARD]
    total.backward()
    errs += [err("expert_outputs.grad", answer["grads"][0], outs[r].grad),
             err("weights.grad", answer["grads"][1], ws[r].grad)]
    if t > 1 and not any(errs):
        el, sent, got = outs[r].element_size(), len(p.routes[r].order), len(p.src[r])
        errs += [compare(answer, phase, expected("ep_combine", sent, got, case["E"], t, el, phase))
                 for phase in ("forward", "backward")]
    return errs


def _moe_inputs(case, t):
    num_experts, dtype = case["E"], case["dtype"]
    w = randn((HID, num_experts), 60)
    xs = [randn((tokens_of(s), HID), 70 + s) for s in range(t)]
    if case.get("skew"):             # a constant feature: the last expert starves, expert 0 is everyone's favourite
        for x in xs:
            x[:, 0] = 1.0
        w[0, -1], w[0, 0] = -30.0, 2.0
    return w.to(dtype), [x.to(dtype) for x in xs]


_MOE_RAISES = {"split": "{E} experts do not split over {t} ranks", "k": "k > E = {E}",
               "capacity": "capacity_factor = {cf}", "shape": "router_weight has a row more than the tokens' size"}


def moe_answer(fn, case, r, t, group):
    num_experts, k, dtype, cf = case["E"], case["k"], case["dtype"], case.get("capacity")
    w, xs = _moe_inputs(case, t)
    local = max(1, num_experts // t)
    experts = make_experts(num_experts, seed=3, dtype=dtype)[r * local:(r + 1) * local]
    if case.get("raises"):
        bad = case["raises"]
        args = (on_rank(xs[r]), on_rank(w if bad != "shape" else torch.cat([w, w[:1]])), experts,
                k if bad != "k" else num_experts + 1, group)
        return attempt(fn, args, dict(capacity_factor=cf))
    x, wr = on_rank(xs[r]).requires_grad_(), on_rank(w).requires_grad_()
    ups = [randn((tokens_of(s), HID), 80 + s, dtype) for s in range(t)]
    given = (x * 1, wr * 1)
    with trace() as tf:
        result = fn(*given, experts, k, group, capacity_factor=cf)
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    answer = {"shape": ok, "y": result[0] if ok else None, "aux": result[1] if ok else None,
              "given": [digest(g) for g in given], "forward": traffic(tf)}
    if not forward_passed(moe_verdict, case, r, t, answer):
        return answer
    with trace() as tb:
        ((result[0] * on_rank(ups[r])).sum() + AUX * result[1]).backward()
    experts_grads = [[[name, param.grad] for name, param in expert.named_parameters()] for expert in experts]
    return {**answer, "grads": (x.grad, wr.grad), "experts": experts_grads, "backward": traffic(tb)}


def _moe_reference(case: dict, t: int):
    """The layer of a case in one process, for every group rank s: (output, aux loss, x.grad,
    router_weight.grad, choices kept) per s, and every expert's gradients. Computed once per
    (case, t): a group's ranks share it, and a rank asks twice (forward, then the whole answer);
    each caller gets its own copy, so no caller can change what the next one compares with."""
    return copy.deepcopy(_moe_reference_once(tuple(sorted(case.items())), t))


@functools.lru_cache(maxsize=4)
def _moe_reference_once(items: tuple, t: int):
    case = dict(items)
    num_experts, k, dtype, cf = case["E"], case["k"], case["dtype"], case.get("capacity")
    w, xs = _moe_inputs(case, t)
    reference = make_experts(num_experts, seed=3, dtype=dtype, device=CPU)
    ups = [randn((tokens_of(s), HID), 80 + s, dtype) for s in range(t)]
    total, per_rank = 0, []
    for s in range(t):
        x = xs[s].clone().requires_grad_()
        ws = w.clone().requires_grad_()
        logits = x @ ws
        idx, weights, keep = ref.top_k_router(logits, k, cf)
        aux = ref.load_balancing_loss(torch.softmax(logits, -1), idx, num_experts)
        y = x.new_zeros(x.shape)
        for c in range(k):
            for j in range(num_experts):
                rows = ((idx[:, c] == j) & keep[:, c]).nonzero().flatten()
                y = y.index_add(0, rows, reference[j](x[rows]) * weights[rows, c, None])
        total = total + (y * ups[s]).sum() + AUX * aux
        per_rank.append((y, aux, x, ws, int(keep.sum())))
    total.backward()
    return ([(y.detach(), aux.detach(), x.grad, ws.grad, sent) for y, aux, x, ws, sent in per_rank],
            [[p.grad for p in expert.parameters()] for expert in reference])


def moe_verdict(case, r, t, answer):
    num_experts, k, cf = case["E"], case["k"], case.get("capacity")
    if case.get("raises"):
        return raise_verdict(answer, _MOE_RAISES[case["raises"]].format(E=num_experts, t=t, cf=cf))
    if not answer["shape"]:
        return ["moe_layer must return (output, load-balancing loss)"]
    w, xs = _moe_inputs(case, t)
    local = max(1, num_experts // t)
    per_rank, expert_grads = _moe_reference(case, t)
    y, aux, x_grad, w_grad, sent = per_rank[r]
    errs = [err("the output", answer["y"], y), err("the load-balancing loss", answer["aux"], aux),
            unchanged("x", answer["given"][0], xs[r]), unchanged("router_weight", answer["given"][1], w)]
    if any(errs) or "backward" not in answer:
        return errs if any(errs) else [NO_BACKWARD]
    errs += [err("x.grad", answer["grads"][0], x_grad), err("router_weight.grad", answer["grads"][1], w_grad)]
    for j, grads in enumerate(answer["experts"]):
        for (name, grad), theirs in zip(grads, expert_grads[r * local + j]):
            errs.append(err(f"local expert {j} (expert {r * local + j}) {name}.grad", grad, theirs))
    if t > 1 and not any(errs):
        got = _received(case, xs, w, t, r, k, cf)
        errs += [compare(answer, phase, expected("moe_layer", sent, got, num_experts, t, xs[r].element_size(), phase))
                 for phase in ("forward", "backward")]
    return errs


def _received(case, xs, w, t, r, k, cf) -> int:
    """Rows group rank r's experts receive: every rank's kept choices of r's experts."""
    local = case["E"] // t
    got = 0
    for s in range(t):
        idx, _, keep = ref.top_k_router(xs[s] @ w, k, cf)
        got += int(((idx // local == r) & keep).sum())
    return got


CASE_RUNNERS = {"ep_dispatch": RankRunner(dispatch_answer, dispatch_verdict),
                "ep_combine": RankRunner(combine_answer, combine_verdict),
                "moe_layer": RankRunner(moe_answer, moe_verdict)}
