"""Lab 9's verdicts: each answer against the same Mixture-of-Experts computed in one process (the
library's: :mod:`minidist.expert_parallel`'s router and loss, its one-process dispatch of the whole
group :func:`~minidist.expert_parallel.simulate_dispatch`, and :func:`~minidist.expert_parallel.moe_reference`;
on the CPU in the case's dtype; every value within ``cases.TOL``, integers and booleans exactly), the caller's tensors unchanged, and, for t > 1,
the all-to-alls traced (kind, bytes) against :mod:`minidist.cost.expert_parallel`: the counts
first, then the rows. No student code runs here, so the grader's judge gives them again.

Lepikhin et al. 2020 (GShard, Sec. 2: dispatch and combine by all-to-all), Fedus et al. 2021
(Switch, Sec. 2: capacity and the load-balancing loss).
"""
from __future__ import annotations

from functools import partial

import torch

from minidist.checks.kit.compare import first, tensor_error, traffic_problem, unchanged
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.raises import raise_verdict
from minidist.checks.kit.returned import returned_problem
from minidist.checks.lab9_expert_parallel.cases import (AUX, CPU, HID, MOE_RAISES, TOL, combine_inputs,
                                                        dispatch_inputs, dispatch_raise, dispatch_upstream,
                                                        loss_inputs, make_experts, moe_inputs, moe_upstream,
                                                        once, router_logits, router_upstream, tokens_of)
from minidist.checks.lab9_expert_parallel.route import Route, route_of
from minidist.cost import expert_parallel as cost
from minidist.expert_parallel import expert_capacity, load_balancing_loss, moe_reference, top_k_router, within_capacity

#: the lab's comparison: kit.compare's, within TOL (fp32 and fp64 alike) of the layer in one process
close = partial(tensor_error, tol=TOL, against="one process")
#: the same for the functions that do not communicate: their reference is not "one process" of many
local = partial(tensor_error, tol=TOL)
#: a forward pass that passes, with no backward answered yet: the rank then runs the backward pass
NO_BACKWARD = "the backward pass did not run"


def _raise_problem(label: str, what: str, answer: dict) -> str | None:
    problem = raise_verdict(answer, what)
    return f"{label}: {problem}" if problem else None


# ----------------------------------------------------------------------------- in this process
def router(case, answer) -> str | None:
    label = f"top_k_router ({describe_case(case)})"
    if case.get("raises"):
        return _raise_problem(label, case["raises"], answer)
    if "foreign" in answer:
        return returned_problem(answer)
    result, logits, k = answer["result"], router_logits(case), case["k"]
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return f"{label}: must return (expert_indices, weights, keep)"
    theirs = logits.clone().requires_grad_()
    want = top_k_router(theirs, k, case["capacity"])[:3]          # indices, weights, mask
    sizes = {"k": k, "E, the number of experts": logits.shape[-1]}
    problem = (local("expert_indices", result[0], want[0]) or local("weights", result[1], want[1].detach(), factors=sizes)
               or _keep(result[2], want, case) or unchanged("logits", answer["given"], logits))
    if not problem:
        (want[1] * router_upstream(case)).sum().backward()
        problem = local("logits.grad", answer["grad"], theirs.grad, factors=sizes)
    return f"{label}: {problem}" if problem else None


def _keep(got, want, case) -> str | None:
    """keep against the reference's; a queue in token order (each token's choices together) is named:
    the rule the lab stresses is that every first choice is queued before any second choice."""
    problem = local("keep", got, want[2])
    if (problem and isinstance(got, torch.Tensor) and got.dtype == torch.bool and got.shape == want[2].shape
            and case["k"] > 1 and case["capacity"] is not None):
        n, num_experts = want[0].shape[0], case["E"]
        slots = expert_capacity(n, num_experts, case["k"], case["capacity"])
        if torch.equal(got, within_capacity(want[0].reshape(-1), num_experts, slots).view(n, -1)):   # token order
            return (f"{problem}: your queue takes each token's choices together (token order); the capacity rule "
                    f"queues every token's first choice before any token's second choice (first choices first), "
                    f"so a later token's first choice wins a slot over an earlier token's second")
    return problem


def loss(case, answer) -> str | None:
    label = f"load_balancing_loss ({describe_case(case)})"
    if case.get("raises"):
        return _raise_problem(label, f"router_probs has {case['E']} columns for {case['E'] + 1} experts", answer)
    if "foreign" in answer:
        return returned_problem(answer)
    probs, idx = loss_inputs(case)
    theirs = probs.clone().requires_grad_()
    want = load_balancing_loss(theirs, idx, case["E"])
    sizes = {"k": idx.shape[-1], "E, the number of experts": case["E"], "n, the number of tokens": probs.shape[0]}
    problem = (local("the loss", answer["loss"], want.detach(), factors=sizes)
               or unchanged("router_probs", answer["given"][0], probs) or unchanged("expert_indices", answer["given"][1], idx))
    if not problem:
        want.backward()
        problem = local("router_probs.grad", answer["grad"], theirs.grad, factors=sizes)
    return f"{label}: {problem}" if problem else None


# ----------------------------------------------------------------------------- traffic
def expected(name, sent, received, num_experts, t, elem_bytes, phase) -> list:
    """Payload bytes of ``name``'s all-to-alls in ``phase``, from :func:`cost.ep_collectives` (a layer's five:
    forward counts, dispatch A rows, combine R rows; backward combine's A rows, dispatch's R rows)."""
    layer = [c.nbytes for c in cost.ep_collectives(sent, received, HID, num_experts, t, elem_bytes) if c.phase == phase]
    if name == "ep_dispatch":
        return layer[:2] if phase == "forward" else layer[1:]
    if name == "ep_combine":
        return layer[2:] if phase == "forward" else layer[:1]
    return layer


def _traffic(answer: dict, phase: str, want: list) -> str | None:
    """Whether the all-to-alls the rank traced in ``phase`` carried the bytes ``want``."""
    return traffic_problem(phase, answer[phase], [["all-to-all", b] for b in want])


# ----------------------------------------------------------------------------- on ranks
def dispatch(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    if case.get("raises"):
        return raise_verdict(answer, dispatch_raise(case, r, t)[1])
    if not answer["shape"]:
        return "ep_dispatch must return (expert_inputs, route)"
    toks, picks, sim = dispatch_inputs(case, t)
    k = case["k"]
    want_rows = torch.stack([toks[s][q // k] for s, q in zip(sim[r].source.tolist(), sim[r].pair.tolist())]) \
        if len(sim[r].source) else toks[r].new_zeros(0, HID)
    errs = [close("expert_inputs", answer["rows"], want_rows), unchanged("expert_indices", answer["idx"], picks[r]),
            unchanged("tokens", answer["given"], toks[r])]
    want_route = route_of(sim[r].plan)
    for field in Route._fields:
        got = answer["route"][field]
        if isinstance(got, torch.Tensor) and field == "recv_counts":
            got = got.reshape(t, -1)
        errs.append(close(f"route.{field}", got, getattr(want_route, field)))
    if any(errs) or "backward" not in answer:
        return first(errs) or NO_BACKWARD
    ups = dispatch_upstream(case, sim, t)
    want_grad = toks[r].new_zeros(tokens_of(r), HID)
    for d in range(t):
        mine = sim[d].source == r
        want_grad.index_add_(0, sim[d].pair[mine] // k, ups[d][mine])
    errs.append(close("tokens.grad", answer["grad"], want_grad))
    if t > 1 and not any(errs):
        el, sent, got = toks[r].element_size(), len(want_route.order), len(sim[r].source)
        errs += [_traffic(answer, phase, expected("ep_dispatch", sent, got, case["E"], t, el, phase))
                 for phase in ("forward", "backward")]
    return first(errs)


def combine(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    sim, outs, ws, ups = combine_inputs(case, t)
    k, total = case["k"], 0
    for s in range(t):               # the reference: every rank's tokens, in one process
        y = outs[s].new_zeros(tokens_of(s), HID)
        for d in range(t):
            mine = sim[d].source == s
            pairs = sim[d].pair[mine]
            y = y.index_add(0, pairs // k, outs[d][mine] * ws[s].reshape(-1)[pairs, None])
        if s == r:
            want_y = y.detach()
        total = total + (y * ups[s]).sum()
    errs = [close("the output", answer["y"], want_y),
            unchanged("expert_outputs", answer["given"][0], outs[r].detach()),
            unchanged("weights", answer["given"][1], ws[r].detach())]
    if any(errs) or "backward" not in answer:
        return first(errs) or NO_BACKWARD
    total.backward()
    errs += [close("expert_outputs.grad", answer["grads"][0], outs[r].grad),
             close("weights.grad", answer["grads"][1], ws[r].grad)]
    if t > 1 and not any(errs):
        el, sent, got = outs[r].element_size(), len(sim[r].plan.pairs), len(sim[r].source)
        errs += [_traffic(answer, phase, expected("ep_combine", sent, got, case["E"], t, el, phase))
                 for phase in ("forward", "backward")]
    return first(errs)


@once
def moe_expected(case: dict, t: int):
    """The layer of a case in one process (:func:`minidist.expert_parallel.moe_reference`, each group
    rank's tokens routed on their own, as on the ranks): per group rank s (output, aux loss, x.grad,
    router_weight.grad, rows it sends, rows its experts receive), and every expert's gradients."""
    num_experts, k, dtype, cf = case["E"], case["k"], case["dtype"], case.get("capacity")
    w, xs = moe_inputs(case, t)
    experts = make_experts(num_experts, seed=3, dtype=dtype, device=CPU)
    ups = moe_upstream(case, t)
    total, per_rank, routings = 0, [], []
    for s in range(t):
        x = xs[s].clone().requires_grad_()
        ws = w.clone().requires_grad_()
        y, (routing,) = moe_reference(x, ws.t(), experts, k, cf)       # the library's router weight is (E, h)
        aux = load_balancing_loss(routing.probs, routing.indices, num_experts)
        total = total + (y * ups[s]).sum() + AUX * aux
        per_rank.append((y, aux, x, ws))
        routings.append(routing)
    total.backward()
    local = num_experts // t
    received = [sum(int(((rt.indices // local == r) & rt.mask).sum()) for rt in routings) for r in range(t)]
    return ([(y.detach(), aux.detach(), x.grad, ws.grad, int(rt.mask.sum()), got)
             for (y, aux, x, ws), rt, got in zip(per_rank, routings, received)],
            [[p.grad for p in expert.parameters()] for expert in experts])


def layer(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    num_experts, cf = case["E"], case.get("capacity")
    if case.get("raises"):
        return raise_verdict(answer, MOE_RAISES[case["raises"]].format(E=num_experts, t=t, cf=cf))
    if not answer["shape"]:
        return "moe_layer must return (output, load-balancing loss)"
    w, xs = moe_inputs(case, t)
    local = max(1, num_experts // t)
    per_rank, expert_grads = moe_expected(case, t)
    y, aux, x_grad, w_grad, sent, got = per_rank[r]
    errs = [close("the output", answer["y"], y), close("the load-balancing loss", answer["aux"], aux),
            unchanged("x", answer["given"][0], xs[r]), unchanged("router_weight", answer["given"][1], w)]
    if any(errs) or "backward" not in answer:
        return first(errs) or NO_BACKWARD
    errs += [close("x.grad", answer["grads"][0], x_grad), close("router_weight.grad", answer["grads"][1], w_grad)]
    for j, grads in enumerate(answer["experts"]):
        for (name, grad), theirs in zip(grads, expert_grads[r * local + j]):
            errs.append(close(f"local expert {j} (expert {r * local + j}) {name}.grad", grad, theirs))
    if t > 1 and not any(errs):
        errs += [_traffic(answer, phase, expected("moe_layer", sent, got, num_experts, t, xs[r].element_size(), phase))
                 for phase in ("forward", "backward")]
    return first(errs)
