"""Lab 9's cases: the visible case tables (the hidden ones are the grader's, in ``hidden.py``), the
tokens, expert choices, experts and gradients every case draws from its seeds (so one process
rebuilds any rank's case), and what a passing test's ✓ line says it covered.

Group rank s holds ``N + s`` tokens (uneven on purpose); hidden cases send every token to one
rank, starve an expert, or drop every choice of a rank. Routes and rows of a whole group come from
the library's one-process dispatch, :func:`minidist.expert_parallel.simulate_dispatch`.

Expected values are computed once per (case, t), before the ranks are launched (:func:`once`,
:func:`prepare`): the verdicts compare with :mod:`minidist.expert_parallel`, and a rank judges its
answers as it goes (``kit/run.py``), under the refusal of that same library. So each value is computed
where the library is allowed: in the process that launches the ranks (the forked ranks inherit it),
or in the grader's judge, which runs no student code. Each caller gets its own copy, so no caller can
change what the next one compares with.
"""
from __future__ import annotations

import copy
import functools

import torch

import minidist
from minidist.checks.kit.compare import seeded
from minidist.checks.kit.withheld import hidden_cases
from minidist.expert_parallel import simulate_dispatch

WORLD, HID, FFN, N = 4, 6, 8, 5          # ranks, token size, expert hidden size, tokens on group rank 0
AUX = 0.5                                # weight of the load-balancing loss in the moe_layer checks' loss
F32, F64 = torch.float32, torch.float64
CPU = torch.device("cpu")
TOL = 1e-5                               # relative, in fp32 and fp64 alike: every value against one process
GRADED = ("top_k_router", "load_balancing_loss", "ep_dispatch", "ep_combine", "moe_layer")

_EXPECTED: dict = {}


def once(fn):
    """``fn(case, t)``, an expected value: computed the first time it is asked for, then copied."""
    @functools.wraps(fn)
    def cached(case: dict, t: int):
        key = (fn.__module__, fn.__qualname__, tuple(sorted(case.items())), t)
        if key not in _EXPECTED:
            _EXPECTED[key] = fn(case, t)
        return copy.deepcopy(_EXPECTED[key])
    return cached


def prepare(case_list, *values):
    """``case_list(hidden)``, with each of the expected ``values`` (functions made by :func:`once`)
    computed in this process for every case that runs (bad input computes nothing)."""
    def prepared(hidden: bool) -> list[dict]:
        cases = case_list(hidden)
        for case in cases:
            if not case.get("raises"):
                for value in values:
                    value(case, case["t"])
        return cases
    return prepared


# ----------------------------------------------------------------------------- the case tables
def router_cases(hidden: bool) -> list[dict]:
    cases = [dict(n=10, E=4, k=2, capacity=None, dtype=F32), dict(n=10, E=4, k=1, capacity=1.0, dtype=F32, skew=3.0),
             # first choices first: here a queue in token order would keep 6 other choices
             dict(n=10, E=4, k=2, capacity=1.0, dtype=F32, skew=3.0)]
    if hidden:
        cases += hidden_cases(__package__, "top_k_router").ROUTER
    return cases


def loss_cases(hidden: bool) -> list[dict]:
    cases = [dict(n=10, E=4, k=2, dtype=F32)]
    if hidden:
        cases += hidden_cases(__package__, "load_balancing_loss").LOSS
    return cases


def exchange_cases(name: str, hidden: bool) -> list[dict]:
    """``ep_dispatch``'s and ``ep_combine``'s cases on groups of t ranks (dispatch's bad input too)."""
    cases = [dict(t=t, E=2 * t, k=2, dtype=F32) for t in (2, 4)]
    if name == "ep_dispatch":       # the input checked before the first collective (the lab's text stresses it)
        cases += [dict(t=2, E=3, k=1, dtype=F32, raises="split")]
    if hidden:
        h = hidden_cases(__package__, name)
        cases += h.EXCHANGE + (h.DISPATCH_RAISES if name == "ep_dispatch" else [])
    return cases


def moe_cases(hidden: bool) -> list[dict]:
    cases = [dict(t=t, E=2 * t, k=2, dtype=F32) for t in (2, 4)]
    if hidden:
        cases += hidden_cases(__package__, "moe_layer").MOE
    return cases


def _ks_and_dtypes(cases: list[dict]) -> str:
    ran = [c for c in cases if not c.get("raises")]
    ks = sorted({c["k"] for c in ran}) + (["E"] if any(c["k"] == c["E"] for c in ran) else [])
    dtypes = "/".join(n for n, d in (("fp32", F32), ("fp64", F64)) if any(c["dtype"] == d for c in ran))
    return f"k = {', '.join(map(str, ks))}, {dtypes}"


def router_covered(hidden: bool) -> str:
    """What the ✓ line says, from the cases that ran."""
    cases = router_cases(hidden)
    dropping = [c for c in cases if c["capacity"] is not None and not c.get("raises")]
    capacity = ("capacity dropping" + (" (first choices first)" if any(c["k"] > 1 for c in dropping) else "")
                + (" and dropless" if any(c["capacity"] is None for c in cases) else "")) if dropping else "dropless"
    return (f"indices, weights and their gradient, kept choices; {_ks_and_dtypes(cases)}, {capacity}"
            + (", bad k and capacity" if any(c.get("raises") for c in cases) else ""))


def loss_covered(hidden: bool) -> str:
    cases = loss_cases(hidden)
    return (f"value and gradient; {_ks_and_dtypes(cases)}"
            + (", an expert nobody chose" if any(c.get("starve") for c in cases) else "")
            + (", probs that do not match E" if any(c.get("raises") for c in cases) else ""))


_COVERED = {"ep_dispatch": "rows, route, tokens.grad and traced bytes",
            "ep_combine": "output, expert_outputs.grad, weights.grad and traced bytes",
            "moe_layer": "output, aux loss, x/router/expert gradients and traced bytes"}


def on_ranks_covered(name: str, hidden: bool) -> str:
    ts = sorted({c["t"] for c in (moe_cases(hidden) if name == "moe_layer" else exchange_cases(name, hidden))})
    extra = "; " + (hidden_cases(__package__, name).COVERED[name] if hidden else
                    "k = 2, fp32" + (", E that does not split over t" if name == "ep_dispatch" else ""))
    return f"t = {', '.join(map(str, ts))}: {_COVERED[name]}{extra}"


# ----------------------------------------------------------------------------- data
def make_experts(num_experts: int, hidden: int = HID, ffn: int = FFN, seed: int = 0, dtype=F32, device=None) -> list:
    """E experts, each Linear(hidden, ffn) → GELU → Linear(ffn, hidden), drawn on the CPU from ``seed``
    (the same on every rank), then moved to ``device`` (default ``minidist.device()``)."""
    experts = []
    for j in range(num_experts):
        layers = []
        for i, (fan_in, fan_out) in enumerate(((hidden, ffn), (ffn, hidden))):
            lin = torch.nn.Linear(fan_in, fan_out, device=CPU, dtype=F64)
            at = 1000 * seed + 4 * j + 2 * i
            with torch.no_grad():
                lin.weight.copy_(seeded((fan_out, fan_in), at, F64) / fan_in ** 0.5)
                lin.bias.copy_(0.1 * seeded((fan_out,), at + 1, F64))
            layers.append(lin)
        expert = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1]).to(dtype)
        experts.append(expert.to(device if device is not None else minidist.device()))
    return experts


def tokens_of(s: int) -> int:
    return N + s


def choices(case: dict, s: int, t: int) -> torch.Tensor:
    """Group rank s's expert indices (n, k): distinct experts per token; ``load`` shapes them:
    random, one_rank (only group rank 0's experts), empty_expert (each rank's last expert never chosen),
    dropped (a third of the choices −1, group rank 0's all of them: it sends nothing)."""
    num_experts, k, load = case["E"], case["k"], case.get("load", "random")
    local, n = num_experts // t, tokens_of(s)
    gen = torch.Generator().manual_seed(1000 + 31 * s + 7 * num_experts + k)
    allowed = torch.arange(num_experts, device=CPU)
    if load == "one_rank":
        allowed = allowed[:local]
    elif load == "empty_expert":
        allowed = allowed[allowed % local != local - 1]
    idx = allowed[torch.rand(n, len(allowed), generator=gen, device=CPU).argsort(-1)[:, :k]]
    if load == "dropped":
        drop = torch.rand(n, k, generator=gen, device=CPU) < 0.35
        idx = idx.masked_fill(drop | (s == 0), -1)
    return idx


def router_logits(case: dict) -> torch.Tensor:
    n, num_experts = case["n"], case["E"]
    favourites = torch.arange(num_experts, 0, -1, device=CPU) / num_experts      # expert 0 most
    logits = (seeded((n, num_experts), 5 + n, F64) + case.get("skew", 0.0) * favourites).to(case["dtype"])
    return logits[None] if "dimensions" in case.get("raises", "") else logits


def router_upstream(case: dict) -> torch.Tensor:
    """The gradient the check sends back through the router's weights."""
    return seeded((case["n"], case["k"]), 6, case["dtype"])


def loss_inputs(case: dict):
    """(router probabilities, the top-k expert indices) of a load_balancing_loss case."""
    logits = seeded((case["n"], case["E"]), 8 + case["n"], F64)
    if case.get("starve"):
        logits[:, -1] = -50.0
    probs = torch.softmax(logits, -1).to(case["dtype"])
    return probs, probs.topk(case["k"], dim=-1).indices


@once
def group_dispatch(case: dict, t: int) -> list:
    """The whole group's dispatch of the case's choices (−1: dropped), in one process: per group rank,
    its plan and the source rank and pair of every row its experts receive (``SimulatedDispatch``)."""
    picks = [choices(case, s, t) for s in range(t)]
    return simulate_dispatch([p.clamp(min=0) for p in picks], case["E"], [p >= 0 for p in picks])


def dispatch_inputs(case: dict, t: int):
    """(every group rank's tokens, their expert indices, the group's dispatch); none for bad input."""
    toks = [seeded((tokens_of(s), HID), 10 + s, case["dtype"]) for s in range(t)]
    if case.get("raises"):
        return toks, None, None
    return toks, [choices(case, s, t) for s in range(t)], group_dispatch(case, t)


def dispatch_upstream(case: dict, group: list, t: int) -> list:
    """Per group rank, the gradient the check sends back through the rows its experts received."""
    return [seeded((len(group[d].source), HID), 20 + d, case["dtype"]) for d in range(t)]


def dispatch_raise(case: dict, r: int, t: int):
    """Bad input of a dispatch case: (expert indices for rank r, why it must raise)."""
    idx = torch.zeros(tokens_of(r) + (case["raises"] == "rows"), case["k"], dtype=torch.long, device=CPU)
    what = (f"{case['E']} experts do not split over {t} ranks" if case["raises"] == "split"
            else "expert_indices has a row more than there are tokens")
    return idx, what


def combine_inputs(case: dict, t: int):
    """(the group's dispatch, expert outputs, weights and upstream gradients per group rank)."""
    k, dtype = case["k"], case["dtype"]
    group = group_dispatch(case, t)
    outs = [seeded((len(group[d].source), HID), 30 + d, dtype).requires_grad_() for d in range(t)]
    ws = [seeded((tokens_of(s), k), 40 + s, dtype).abs().requires_grad_() for s in range(t)]
    ups = [seeded((tokens_of(s), HID), 50 + s, dtype) for s in range(t)]
    return group, outs, ws, ups


def moe_inputs(case: dict, t: int):
    """(router weight, every group rank's tokens) of a moe_layer case."""
    num_experts, dtype = case["E"], case["dtype"]
    w = seeded((HID, num_experts), 60, F64)
    xs = [seeded((tokens_of(s), HID), 70 + s, F64) for s in range(t)]
    if case.get("skew"):             # a constant feature: the last expert starves, expert 0 is everyone's favourite
        for x in xs:
            x[:, 0] = 1.0
        w[0, -1], w[0, 0] = -30.0, 2.0
    return w.to(dtype), [x.to(dtype) for x in xs]


def moe_upstream(case: dict, t: int) -> list:
    return [seeded((tokens_of(s), HID), 80 + s, case["dtype"]) for s in range(t)]


MOE_RAISES = {"split": "{E} experts do not split over {t} ranks", "k": "k > E = {E}",
              "capacity": "capacity_factor = {cf}", "shape": "router_weight has a row more than the tokens' size"}
