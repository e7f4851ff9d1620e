"""Lab 9's checks (expert parallelism: a Mixture-of-Experts layer whose experts live on different
ranks): each graded function against the same layer in one process, and its traced all-to-alls
against the cost model.

Shazeer et al. 2017 (sparsely-gated top-k MoE), Lepikhin et al. 2020 (GShard: capacity, dispatch and
combine by all-to-all), Fedus et al. 2021 (Switch Transformers: the load-balancing loss
``E · Σ_i f_i · P_i``). A lab test cell is a one-liner::

    checks.check_function("ep_dispatch", ep_dispatch)
    checks.check_function("ep_dispatch", ep_dispatch, hidden=True)

``top_k_router`` and ``load_balancing_loss`` communicate nothing and are checked in this process.
The distributed ones run one launch of 4 ranks per call, cut into expert-parallel groups of t
consecutive ranks (visible t = 2, 4; hidden t = 1, 2, 4). A case compares, on every rank, the
outputs and every gradient (tokens, expert outputs, router weights, every local expert's
parameters) with one process within ``TOL``, checks that the caller's tensors are unchanged, and
for t > 1 that the traced all-to-alls (kind, bytes) equal :mod:`minidist.cost.expert_parallel`:
the counts first, then the rows. Loads are uneven on purpose: group rank s holds ``5 + s`` tokens,
and hidden cases send every token to one rank, starve an expert, or drop every choice of a rank.
The lab's other functions are stood in for by the lab's reference inside the ranks
(:mod:`minidist.checks.lab9_reference`); ``minidist.expert_parallel`` is refused while graded code
runs. The runners are in :mod:`minidist.checks.lab9_cases`, their data in :mod:`minidist.checks.lab9_data`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import minidist
from minidist.checks import lab9_reference as ref
from minidist.checks.kit.launch import check_timeout, launch_named, mark_case, one_thread, report_passed, stand_in_lab_functions
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, judged, outcome
from minidist.checks.kit.returned import require_plain
from minidist.checks.kit.groups import describe_case, judged_on_ranks, raise_first_group_problem, run_cases_in_groups
from minidist.checks.lab9_cases import CASE_RUNNERS
from minidist.checks.lab9_data import F32, F64, WORLD, choices, err, make_experts, randn  # noqa: F401
from minidist.checks.kit.quiet import passes_quietly
from minidist.cost import expert_parallel as cost
from minidist.trace import trace

Route = ref.Route                       # handed out: what ep_dispatch returns for ep_combine
EP_CHECK_TIMEOUT = check_timeout(20.0)
GRADED = ("top_k_router", "load_balancing_loss", "ep_dispatch", "ep_combine", "moe_layer")

#: the notebook's functions stood in for by the reference inside the ranks, except the graded one's own cell
STAND_INS = {"top_k_router": ref.top_k_router, "load_balancing_loss": ref.load_balancing_loss,
             "ep_dispatch": ref.ep_dispatch, "all_to_all_rows": ref.all_to_all_rows,
             "AllToAllRows": ref.AllToAllRows, "ep_combine": ref.ep_combine}
OWN_CELL = {"ep_dispatch": ("ep_dispatch", "all_to_all_rows", "AllToAllRows")}

#: minidist's expert parallelism is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("expert parallelism", ("minidist.expert_parallel",), checks=__name__)


def _body(progress, fn, name, cases):
    own = OWN_CELL.get(name, (name,))
    stand_in_lab_functions(fn, {other: stand_in for other, stand_in in STAND_INS.items() if other not in own})
    return run_cases_in_groups(progress, CASE_RUNNERS[name], fn, cases, WORLD)


def _cases(name: str, hidden: bool) -> list[dict]:
    if name == "ep_dispatch" or name == "ep_combine":
        cases = [dict(t=t, E=2 * t, k=2, dtype=F32) for t in (2, 4)]
        if hidden:
            cases += [dict(t=1, E=4, k=2, dtype=F64), dict(t=2, E=2, k=1, dtype=F64),
                      dict(t=4, E=8, k=1, dtype=F32, load="one_rank"), dict(t=2, E=8, k=2, dtype=F64, load="one_rank"),
                      dict(t=4, E=8, k=2, dtype=F32, load="empty_expert"),
                      dict(t=2, E=6, k=2, dtype=F32, load="dropped"),
                      dict(t=4, E=4, k=1, dtype=F64, load="dropped")]
            if name == "ep_dispatch":
                cases += [dict(t=4, E=6, k=1, dtype=F32, raises="split"), dict(t=2, E=4, k=2, dtype=F32, raises="rows")]
        return cases
    if name == "moe_layer":
        cases = [dict(t=t, E=2 * t, k=2, dtype=F32) for t in (2, 4)]
        if hidden:
            cases += [dict(t=1, E=2, k=1, dtype=F64), dict(t=2, E=4, k=1, dtype=F64, skew=True),
                      dict(t=4, E=8, k=2, dtype=F32, capacity=1.0, skew=True),
                      dict(t=2, E=6, k=2, dtype=F64, capacity=0.5), dict(t=4, E=4, k=1, dtype=F32, capacity=1.5),
                      dict(t=4, E=6, k=1, dtype=F32, raises="split"), dict(t=2, E=4, k=2, dtype=F32, raises="k"),
                      dict(t=2, E=4, k=2, dtype=F32, capacity=0.0, raises="capacity"),
                      dict(t=4, E=4, k=1, dtype=F32, raises="shape")]
        return cases
    raise ValueError(f"lab 9 has no distributed graded function {name!r}; graded: {', '.join(GRADED)}")


# ----------------------------------------------------------------------------- pure checks (this process)
# Judged (minidist.checks.kit.docket): the answers go as plain data to a verdict that recomputes the
# reference, here and in the grader's judge alike.
def _raise_problem(label, what, answer) -> str | None:
    if answer.get("raised") == "ValueError":
        return None
    if "raised" in answer:
        return (f"{label}: raised {answer['raised']} ({answer.get('message')}) although {what}; the lab asks for a "
                "ValueError with a clear message")
    return f"{label}: returned although {what}; the lab asks for a ValueError"


def _backward_grad(output, upstream, leaf):
    """``leaf.grad`` after ``(output * upstream).sum().backward()`` (None if the output cannot)."""
    try:
        (output * upstream).sum().backward()
    except Exception:      # noqa: BLE001  (a wrong answer's backward may fail: no gradient then)
        return None
    return leaf.grad


def _detached(result):
    if isinstance(result, (tuple, list)):
        return [r.detach() if isinstance(r, torch.Tensor) else r for r in result]
    return result.detach() if isinstance(result, torch.Tensor) else result


def _router_cases(hidden):
    cases = [dict(n=10, E=4, k=2, capacity=None, dtype=F32), dict(n=10, E=4, k=1, capacity=1.0, dtype=F32, skew=3.0)]
    if hidden:
        cases += [dict(n=12, E=8, k=2, capacity=1.25, dtype=F64, skew=3.0),
                  dict(n=9, E=3, k=1, capacity=0.5, dtype=F32),
                  dict(n=16, E=8, k=2, capacity=1.0, dtype=F32, skew=2.0), dict(n=7, E=5, k=5, capacity=None, dtype=F64),
                  dict(n=10, E=4, k=2, capacity=2.0, dtype=F32, skew=4.0), dict(n=11, E=4, k=2, capacity=0.7, dtype=F64),
                  dict(n=6, E=4, k=5, capacity=None, dtype=F32, raises="k > E"),
                  dict(n=6, E=4, k=0, capacity=None, dtype=F32, raises="k = 0"),
                  dict(n=6, E=4, k=1, capacity=0.0, dtype=F32, raises="capacity_factor = 0"),
                  dict(n=6, E=4, k=1, capacity=-1.0, dtype=F32, raises="capacity_factor < 0"),
                  dict(n=6, E=4, k=1, capacity=None, dtype=F32, raises="logits of 3 dimensions")]
    return cases


def _router_logits(case):
    n, num_experts = case["n"], case["E"]
    favourites = torch.arange(num_experts, 0, -1, device="cpu") / num_experts      # expert 0 most
    logits = (randn((n, num_experts), 5 + n) + case.get("skew", 0.0) * favourites).to(case["dtype"])
    return logits[None] if "dimensions" in case.get("raises", "") else logits


def _router_answer(fn, case):
    logits, k = _router_logits(case), case["k"]
    if case.get("raises"):
        return outcome(lambda: graded_call(REFUSED, "top_k_router", fn, logits, k, case["capacity"]))
    mine = logits.clone().requires_grad_()
    given = mine * 1
    result = graded_call(REFUSED, "top_k_router", fn, given, k, case["capacity"])
    require_plain(f"top_k_router ({describe_case(case)})", result)
    grad = None
    if isinstance(result, (tuple, list)) and len(result) == 3:
        grad = _backward_grad(result[1], randn((case["n"], k), 6, case["dtype"]), mine)
    return {"result": _detached(result), "given": given.detach(), "grad": grad}


def _router_verdict(case, answer) -> str | None:
    label = f"top_k_router ({describe_case(case)})"
    if case.get("raises"):
        return _raise_problem(label, case["raises"], answer)
    result, logits, k = answer["result"], _router_logits(case), case["k"]
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return f"{label}: must return (expert_indices, weights, keep)"
    theirs = logits.clone().requires_grad_()
    want = ref.top_k_router(theirs, k, case["capacity"])
    problem = (err("expert_indices", result[0], want[0]) or err("weights", result[1], want[1].detach())
               or err("keep", result[2], want[2])
               or (None if torch.equal(answer["given"], logits) else "the logits were modified in place"))
    if not problem:
        (want[1] * randn((case["n"], k), 6, case["dtype"])).sum().backward()
        problem = err("logits.grad", answer["grad"], theirs.grad)
    return f"{label}: {problem}" if problem else None


def _loss_cases(hidden):
    cases = [dict(n=10, E=4, k=2, dtype=F32)]
    if hidden:
        cases += [dict(n=12, E=8, k=1, dtype=F64), dict(n=10, E=4, k=2, dtype=F32, starve=True),
                  dict(n=9, E=6, k=3, dtype=F64), dict(n=6, E=4, k=1, dtype=F32, raises=True)]
    return cases


def _loss_inputs(case):
    logits = randn((case["n"], case["E"]), 8 + case["n"])
    if case.get("starve"):
        logits[:, -1] = -50.0
    probs = torch.softmax(logits, -1).to(case["dtype"])
    return probs, probs.topk(case["k"], dim=-1).indices


def _loss_answer(fn, case):
    probs, idx = _loss_inputs(case)
    if case.get("raises"):
        return outcome(lambda: graded_call(REFUSED, "load_balancing_loss", fn, probs, idx, case["E"] + 1))
    mine = probs.clone().requires_grad_()
    given = (mine * 1, idx.clone())
    got = graded_call(REFUSED, "load_balancing_loss", fn, *given, case["E"])
    require_plain(f"load_balancing_loss ({describe_case(case)})", got)
    grad = _backward_grad(got, 1.0, mine) if isinstance(got, torch.Tensor) else None
    return {"loss": _detached(got), "given": [given[0].detach(), given[1]], "grad": grad}


def _loss_verdict(case, answer) -> str | None:
    label = f"load_balancing_loss ({describe_case(case)})"
    if case.get("raises"):
        return _raise_problem(label, f"router_probs has {case['E']} columns for {case['E'] + 1} experts", answer)
    probs, idx = _loss_inputs(case)
    theirs = probs.clone().requires_grad_()
    want = ref.load_balancing_loss(theirs, idx, case["E"])
    problem = err("the loss", answer["loss"], want.detach())
    if not problem and not (torch.equal(answer["given"][1], idx) and torch.equal(answer["given"][0], probs)):
        problem = "its inputs were modified in place"
    if not problem:
        want.backward()
        problem = err("router_probs.grad", answer["grad"], theirs.grad)
    return f"{label}: {problem}" if problem else None


#: graded name -> (cases(hidden), the answer of fn to a case, its verdict)
PURE = {"top_k_router": (_router_cases, _router_answer, _router_verdict),
        "load_balancing_loss": (_loss_cases, _loss_answer, _loss_verdict)}
PURE_COVERED = {"top_k_router": lambda hidden: "indices, weights and their gradient, kept choices; k = 1, 2 and k = E, "
                "capacity dropping and dropless, fp32/fp64" + (", bad k and capacity" if hidden else ""),
                "load_balancing_loss": lambda hidden: "value and gradient; k = 1, 2, 3, fp32/fp64"
                + (", an expert nobody chose, probs that do not match E" if hidden else "")}
#: every graded function's verdicts, given again by the grader's judge: the pure ones per case, the
#: others per (case, rank)
JUDGED = Judged.of_functions(__name__, "check_function", {
    **{name: (cases, verdict) for name, (cases, _, verdict) in PURE.items()},
    **{name: judged_on_ranks(name, lambda hidden, name=name: _cases(name, hidden), runner, WORLD)
       for name, runner in CASE_RUNNERS.items()}})


COVERED = {"ep_dispatch": "rows, route, tokens.grad and traced bytes",
           "ep_combine": "output, expert_outputs.grad, weights.grad and traced bytes",
           "moe_layer": "output, aux loss, x/router/expert gradients and traced bytes"}


@judged(JUDGED)
@passes_quietly
def check_function(name: str, fn, hidden: bool = False, timeout: float = EP_CHECK_TIMEOUT) -> None:
    """Lab 9's graded function ``name``. The router and the loss in this process; the others on 4
    ranks cut into groups of t (visible t = 2, 4; hidden 1, 2, 4): outputs and every gradient equal
    one process, the caller's tensors unchanged, the traced all-to-alls equal the cost model.
    Hidden cases: k = 1, fp64, uneven and empty loads, dropped choices, capacity, bad input."""
    params = dict(name=name, hidden=hidden)
    if name in PURE:
        JUDGED.run(params, lambda case: PURE[name][1](fn, case))
        return report_passed(name, PURE_COVERED[name](hidden), hidden)
    cases = _cases(name, hidden)
    out = launch_named(_body, WORLD, fn, name, cases, name=name, timeout=timeout, refuse=REFUSED)
    raise_first_group_problem(name, cases, out, WORLD, JUDGED, params)
    ts = sorted({c["t"] for c in cases})
    extra = "; k = 2, fp32"
    if hidden:
        extra = ("; k = 1, 2, fp32/fp64, capacity and dropless, a starved expert, bad input" if name == "moe_layer" else
                 "; k = 1, 2, fp32/fp64, one busy rank, a starved expert, a rank that sends nothing"
                 + (", bad input" if name == "ep_dispatch" else ""))
    report_passed(name, f"t = {', '.join(map(str, ts))}: {COVERED[name]}{extra}", hidden)


# ----------------------------------------------------------------------------- measurements (demo cells)
MEASURE_SETTINGS = (("balanced", 0.0, None), ("skewed", 1.5, None), ("skewed, capacity 1.25", 1.5, 1.25))


def _measure_body(progress, top_k_router, ep_dispatch, tokens, hidden, num_experts, k, settings):
    rank, device = dist.get_rank(), minidist.device()
    out = []
    for label, skew, cf in settings:
        mark_case(progress, label)
        x = randn((tokens, hidden), 90 + rank, F32)
        w = randn((hidden, num_experts), 91, F32) / hidden ** 0.5
        x[:, 0] = 1.0                                  # a constant feature: its weights are the experts' biases
        w[0] = 0.0
        w[0, :2] = skew                                # a bonus for experts 0 and 1, both on rank 0
        with one_thread():
            idx, _, keep = top_k_router((x @ w).to(device), k, cf)
            keep = keep.to(idx.device)
            with trace() as tr:
                _, route = ep_dispatch(x.to(device), idx.masked_fill(~keep, -1), num_experts)
        out.append(dict(setting=label, rank=rank, received=int(route.recv_counts.sum()), dropped=int((~keep).sum()),
                        sent=int(keep.sum()), bytes=sum(e.nbytes for e in tr.comm())))
    return out


@passes_quietly
def measure(top_k_router, ep_dispatch, tokens: int = 256, hidden: int = 32, num_experts: int = 8, k: int = 2,
            settings=MEASURE_SETTINGS, timeout: float = EP_CHECK_TIMEOUT) -> list[dict]:
    """On 4 ranks, for each (label, skew, capacity factor): your router on each rank's ``tokens`` tokens
    (a bonus logit ``skew`` for experts 0 and 1, on rank 0), then your dispatch. One row per (setting,
    rank): rows its experts ``received``, choices ``dropped``, ``bytes`` your dispatch sent (traced: the
    counts and the rows), ``theory`` (:func:`minidist.cost.expert_parallel.ep_collectives`, the same
    two exchanges), ``mean`` (n·k, a balanced rank's rows)."""
    out = launch_named(_measure_body, WORLD, top_k_router, ep_dispatch, tokens, hidden, num_experts, k,
                       tuple(settings), name="measure", timeout=timeout)
    rows = []
    for i in range(len(settings)):
        for rank_rows in out:
            row = dict(rank_rows[i])
            row["theory"] = sum(c.nbytes for c in cost.ep_collectives(row["sent"], row["received"], hidden,
                                                                      num_experts, WORLD)[:2])
            row["mean"] = tokens * k
            rows.append(row)
    return rows
