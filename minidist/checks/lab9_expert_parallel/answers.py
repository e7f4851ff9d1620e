"""Lab 9's answers, the only code of its checks that calls student code: what the student's function
did on one case, as plain data.

In this process (the whole answer runs as one graded call): the router and the load-balancing loss,
their results and the gradient they send back. On a rank of a group (:class:`~minidist.checks.kit.run.OnRank`):
dispatch, combine and the layer on this rank's inputs (copies on the rank's device), the traffic
traced forward and backward, digests of the caller's tensors. A rank runs the backward pass only
where the forward pass passed its verdict on every rank of its group, as in a correct solution.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.checks.kit.compare import digest, on_rank, traffic
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.raises import outcome
from minidist.checks.kit.raises import attempt
from minidist.checks.kit.returned import returned
from minidist.checks.kit.run import RankCase, every_rank_passed
from minidist.checks.lab9_expert_parallel import verdicts
from minidist.checks.lab9_expert_parallel.cases import (AUX, combine_inputs, dispatch_inputs, dispatch_raise,
                                                        dispatch_upstream, loss_inputs, make_experts, moe_inputs,
                                                        moe_upstream, router_logits, router_upstream)
from minidist.checks.lab9_expert_parallel.route import Route, route_of
from minidist.trace import trace


def _detached(result):
    if isinstance(result, (tuple, list)):
        return [r.detach() if isinstance(r, torch.Tensor) else r for r in result]
    return result.detach() if isinstance(result, torch.Tensor) else result


def _backward_grad(output, upstream, leaf):
    """``leaf.grad`` after ``(output * upstream).sum().backward()`` (None if the output cannot)."""
    try:
        (output * upstream).sum().backward()
    except Exception:      # noqa: BLE001  (a wrong answer's backward may fail: no gradient then)
        return None
    return leaf.grad


# ----------------------------------------------------------------------------- in this process
def router(fn, case) -> dict:
    logits, k = router_logits(case), case["k"]
    if case.get("raises"):
        return outcome(lambda: fn(logits, k, case["capacity"]))
    mine = logits.clone().requires_grad_()
    given = mine * 1
    result = fn(given, k, case["capacity"])
    if "foreign" in (record := returned(result, f"top_k_router ({describe_case(case)})")):
        return record                 # the answer carries no object of the student's
    grad = None
    if isinstance(result, (tuple, list)) and len(result) == 3:
        grad = _backward_grad(result[1], router_upstream(case), mine)
    return {"result": _detached(result), "given": digest(given), "grad": grad}


def loss(fn, case) -> dict:
    probs, idx = loss_inputs(case)
    if case.get("raises"):
        return outcome(lambda: fn(probs, idx, case["E"] + 1))
    mine = probs.clone().requires_grad_()
    given = (mine * 1, idx.clone())
    got = fn(*given, case["E"])
    if "foreign" in (record := returned(got, f"load_balancing_loss ({describe_case(case)})")):
        return record
    grad = _backward_grad(got, 1.0, mine) if isinstance(got, torch.Tensor) else None
    return {"loss": _detached(got), "given": [digest(g) for g in given], "grad": grad}


# ----------------------------------------------------------------------------- on ranks
def _forward_passed(verdict, case, on, answer) -> bool:
    """Whether the forward half of ``answer`` passes on every rank of the group (they then run the
    backward pass together; one rank alone in it would wait for its peers' all-to-alls)."""
    mine = verdict(RankCase(case, dist.get_rank(), on.r, on.t), answer) == verdicts.NO_BACKWARD
    return every_rank_passed(mine, on.group)


def dispatch(fn, case, on) -> dict:
    r, t, group = on
    toks, picks, sim = dispatch_inputs(case, t)
    if case.get("raises"):
        return attempt(fn, (on_rank(toks[r]), on_rank(dispatch_raise(case, r, t)[0]), case["E"], group))
    x = on_rank(toks[r], grad=True)
    given, idx = x * 1, on_rank(picks[r])
    with trace() as tf:
        result = fn(given, idx, case["E"], group)
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    answer = {"rows": result[0] if ok else None, "shape": ok, "idx": digest(idx), "given": digest(given),
              "forward": traffic(tf), "route": {f: getattr(result[1], f, None) for f in Route._fields} if ok else None}
    if not _forward_passed(verdicts.dispatch, case, on, answer):
        return answer
    with trace() as tb:
        (result[0] * on_rank(dispatch_upstream(case, sim, t)[r])).sum().backward()
    return {**answer, "grad": x.grad, "backward": traffic(tb)}


def combine(fn, case, on) -> dict:
    r, t, group = on
    sim, outs, ws, ups = combine_inputs(case, t)
    eo, w = on_rank(outs[r], grad=True), on_rank(ws[r], grad=True)
    route = Route(*(on_rank(x) for x in route_of(sim[r].plan)))
    given = (eo * 1, w * 1)
    with trace() as tf:
        y = fn(*given, route, group)
    answer = {"y": y, "given": [digest(g) for g in given], "forward": traffic(tf)}
    if not _forward_passed(verdicts.combine, case, on, answer):
        return answer
    with trace() as tb:
        (y * on_rank(ups[r])).sum().backward()
    return {**answer, "grads": (eo.grad, w.grad), "backward": traffic(tb)}


def layer(fn, case, on) -> dict:
    r, t, group = on
    num_experts, k, dtype, cf = case["E"], case["k"], case["dtype"], case.get("capacity")
    w, xs = moe_inputs(case, t)
    local = max(1, num_experts // t)
    experts = make_experts(num_experts, seed=3, dtype=dtype)[r * local:(r + 1) * local]
    if case.get("raises"):
        bad = case["raises"]
        args = (on_rank(xs[r]), on_rank(w if bad != "shape" else torch.cat([w, w[:1]])), experts,
                k if bad != "k" else num_experts + 1, group)
        return attempt(fn, args, dict(capacity_factor=cf))
    x, wr = on_rank(xs[r], grad=True), on_rank(w, grad=True)
    given = (x * 1, wr * 1)
    with trace() as tf:
        result = fn(*given, experts, k, group, capacity_factor=cf)
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    answer = {"shape": ok, "y": result[0] if ok else None, "aux": result[1] if ok else None,
              "given": [digest(g) for g in given], "forward": traffic(tf)}
    if not _forward_passed(verdicts.layer, case, on, answer):
        return answer
    with trace() as tb:
        ((result[0] * on_rank(moe_upstream(case, t)[r])).sum() + AUX * result[1]).backward()
    experts_grads = [[[name, param.grad] for name, param in expert.named_parameters()] for expert in experts]
    return {**answer, "grads": (x.grad, wr.grad), "experts": experts_grads, "backward": traffic(tb)}

