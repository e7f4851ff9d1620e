"""Lab 9's verdicts: each answer against the same Mixture-of-Experts computed in one process (the
lab's reference, :mod:`.reference`, on the CPU in the case's dtype; every value within
``cases.TOL``, integers and booleans exactly), the caller's tensors unchanged, and, for t > 1,
the all-to-alls traced (kind, bytes) against :mod:`minidist.cost.expert_parallel`: the counts
first, then the rows. No student code runs here, so the grader's judge gives them again.

Lepikhin et al. 2020 (GShard, Sec. 2: dispatch and combine by all-to-all), Fedus et al. 2021
(Switch, Sec. 2: capacity and the load-balancing loss).
"""
from __future__ import annotations

import copy
import functools
from functools import partial

import torch

from minidist.checks.kit.compare import counted, show, tensor_error, unchanged
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.raises import raise_verdict
from minidist.checks.lab9_expert_parallel import reference as ref
from minidist.checks.lab9_expert_parallel.cases import (AUX, CPU, HID, MOE_RAISES, TOL, combine_inputs,
                                                        dispatch_inputs, dispatch_raise, dispatch_upstream,
                                                        loss_inputs, make_experts, moe_inputs, moe_upstream,
                                                        router_logits, router_upstream, tokens_of)
from minidist.cost import expert_parallel as cost

#: the lab's comparison: kit.compare's, within TOL (fp32 and fp64 alike) of the layer in one process
close = partial(tensor_error, tol=TOL, against="one process")
#: the same for the functions that do not communicate: their reference is not "one process" of many
local = partial(tensor_error, tol=TOL)
#: a forward pass that passes, with no backward answered yet: the rank then runs the backward pass
NO_BACKWARD = "the backward pass did not run"


def _raise_problem(label: str, what: str, answer: dict) -> str | None:
    problem = raise_verdict(answer, what)
    return f"{label}: {problem}" if problem else None


def _not_plain(label: str, answer: dict) -> str | None:
    if "not plain" in answer:
        return (f"{label}: returned {answer['not plain']}: return plain values (numbers, tensors, lists, tuples, "
                f"dicts), not objects of your own (the check compares them outside the graded call)")
    return None


# ----------------------------------------------------------------------------- in this process
def router(case, answer) -> str | None:
    label = f"top_k_router ({describe_case(case)})"
    if case.get("raises"):
        return _raise_problem(label, case["raises"], answer)
    if problem := _not_plain(label, answer):
        return problem
    result, logits, k = answer["result"], router_logits(case), case["k"]
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return f"{label}: must return (expert_indices, weights, keep)"
    theirs = logits.clone().requires_grad_()
    want = ref.top_k_router(theirs, k, case["capacity"])
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
        slots = ref.capacity(case["capacity"], n, case["k"], num_experts)
        if torch.equal(got, ref.queued_within(want[0].reshape(-1), slots, num_experts).view(n, -1)):   # token order
            return (f"{problem}: your queue takes each token's choices together (token order); the capacity rule "
                    f"queues every token's first choice before any token's second choice (first choices first), "
                    f"so a later token's first choice wins a slot over an earlier token's second")
    return problem


def load_balancing_loss(case, answer) -> str | None:
    label = f"load_balancing_loss ({describe_case(case)})"
    if case.get("raises"):
        return _raise_problem(label, f"router_probs has {case['E']} columns for {case['E'] + 1} experts", answer)
    if problem := _not_plain(label, answer):
        return problem
    probs, idx = loss_inputs(case)
    theirs = probs.clone().requires_grad_()
    want = ref.load_balancing_loss(theirs, idx, case["E"])
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
    got, want = counted(answer[phase]), counted([["all-to-all", b] for b in want])
    return None if got == want else f"{phase} communicated {show(got)}; expected {show(want)}"


# ----------------------------------------------------------------------------- on ranks
def ep_dispatch(item, answer) -> list:
    case, _, r, t = item
    if case.get("raises"):
        return raise_verdict(answer, dispatch_raise(case, r, t)[1])
    if not answer["shape"]:
        return ["ep_dispatch must return (expert_inputs, route)"]
    toks, picks, p = dispatch_inputs(case, t)
    k = case["k"]
    want_rows = torch.stack([toks[s][q // k] for s, q in zip(p.src[r].tolist(), p.pair[r].tolist())]) \
        if len(p.src[r]) else toks[r].new_zeros(0, HID)
    errs = [close("expert_inputs", answer["rows"], want_rows), unchanged("expert_indices", answer["idx"], picks[r]),
            unchanged("tokens", answer["given"], toks[r])]
    want_route = p.routes[r]
    for field in ref.Route._fields:
        got = answer["route"][field]
        if isinstance(got, torch.Tensor) and field == "recv_counts":
            got = got.reshape(t, -1)
        errs.append(close(f"route.{field}", got, getattr(want_route, field)))
    if any(errs) or "backward" not in answer:
        return errs if any(errs) else [NO_BACKWARD]
    ups = dispatch_upstream(case, p, t)
    want_grad = toks[r].new_zeros(tokens_of(r), HID)
    for d in range(t):
        mine = p.src[d] == r
        want_grad.index_add_(0, p.pair[d][mine] // k, ups[d][mine])
    errs.append(close("tokens.grad", answer["grad"], want_grad))
    if t > 1 and not any(errs):
        el, sent, got = toks[r].element_size(), len(want_route.order), len(p.src[r])
        errs += [_traffic(answer, phase, expected("ep_dispatch", sent, got, case["E"], t, el, phase))
                 for phase in ("forward", "backward")]
    return errs


def ep_combine(item, answer) -> list:
    case, _, r, t = item
    p, outs, ws, ups = combine_inputs(case, t)
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
    errs = [close("the output", answer["y"], want_y),
            unchanged("expert_outputs", answer["given"][0], outs[r].detach()),
            unchanged("weights", answer["given"][1], ws[r].detach())]
    if any(errs) or "backward" not in answer:
        return errs if any(errs) else [NO_BACKWARD]
    total.backward()
    errs += [close("expert_outputs.grad", answer["grads"][0], outs[r].grad),
             close("weights.grad", answer["grads"][1], ws[r].grad)]
    if t > 1 and not any(errs):
        el, sent, got = outs[r].element_size(), len(p.routes[r].order), len(p.src[r])
        errs += [_traffic(answer, phase, expected("ep_combine", sent, got, case["E"], t, el, phase))
                 for phase in ("forward", "backward")]
    return errs


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
    w, xs = moe_inputs(case, t)
    experts = make_experts(num_experts, seed=3, dtype=dtype, device=CPU)
    ups = moe_upstream(case, t)
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
                y = y.index_add(0, rows, experts[j](x[rows]) * weights[rows, c, None])
        total = total + (y * ups[s]).sum() + AUX * aux
        per_rank.append((y, aux, x, ws, int(keep.sum())))
    total.backward()
    return ([(y.detach(), aux.detach(), x.grad, ws.grad, sent) for y, aux, x, ws, sent in per_rank],
            [[p.grad for p in expert.parameters()] for expert in experts])


def moe_layer(item, answer) -> list:
    case, _, r, t = item
    num_experts, k, cf = case["E"], case["k"], case.get("capacity")
    if case.get("raises"):
        return raise_verdict(answer, MOE_RAISES[case["raises"]].format(E=num_experts, t=t, cf=cf))
    if not answer["shape"]:
        return ["moe_layer must return (output, load-balancing loss)"]
    w, xs = moe_inputs(case, t)
    local = max(1, num_experts // t)
    per_rank, expert_grads = _moe_reference(case, t)
    y, aux, x_grad, w_grad, sent = per_rank[r]
    errs = [close("the output", answer["y"], y), close("the load-balancing loss", answer["aux"], aux),
            unchanged("x", answer["given"][0], xs[r]), unchanged("router_weight", answer["given"][1], w)]
    if any(errs) or "backward" not in answer:
        return errs if any(errs) else [NO_BACKWARD]
    errs += [close("x.grad", answer["grads"][0], x_grad), close("router_weight.grad", answer["grads"][1], w_grad)]
    for j, grads in enumerate(answer["experts"]):
        for (name, grad), theirs in zip(grads, expert_grads[r * local + j]):
            errs.append(close(f"local expert {j} (expert {r * local + j}) {name}.grad", grad, theirs))
    if t > 1 and not any(errs):
        got = _received(case, xs, w, t, r, k, cf)
        errs += [_traffic(answer, phase, expected("moe_layer", sent, got, num_experts, t, xs[r].element_size(), phase))
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
