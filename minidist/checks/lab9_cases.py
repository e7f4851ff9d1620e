"""Lab 9's cases, one runner per distributed graded function: this rank's results against the same
Mixture-of-Experts computed in one process, and the all-to-alls it traced against the cost model.

Lepikhin et al. 2020 (GShard, Sec. 2: dispatch and combine by all-to-all), Fedus et al. 2021
(Switch, Sec. 2: capacity). A runner takes (fn, case, group rank r, group size t, group) and returns a
list of problems (None where all is well). Every rank draws every group rank's tokens and choices
from seeds, so it computes the expected rows, routes and gradients of its whole group alone
(:func:`minidist.checks.lab9_reference.plan`); references run on the CPU in the case's dtype, the
student's code on ``minidist.device()``. Group rank s holds ``N + s`` tokens (uneven on purpose).
Used by :mod:`minidist.checks.lab9_expert_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

from collections import Counter

import torch

import minidist
from minidist.checks import lab9_reference as ref
from minidist.checks.common import TOL
from minidist.checks.returned import not_plain_tensor
from minidist.cost import expert_parallel as cost
from minidist.trace import trace

WORLD, HID, FFN, N = 4, 6, 8, 5          # ranks, token size, expert hidden size, tokens on group rank 0
AUX = 0.5                                # weight of the load-balancing loss in the moe_layer checks' loss
F32, F64 = torch.float32, torch.float64
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- data
def randn(shape, seed, dtype=F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64, device=CPU).to(dtype)


def make_experts(num_experts: int, hidden: int = HID, ffn: int = FFN, seed: int = 0, dtype=F32, device=None) -> list:
    """E experts, each Linear(hidden, ffn) → GELU → Linear(ffn, hidden), drawn on the CPU from ``seed``
    (the same on every rank), then moved to ``device`` (default ``minidist.device()``)."""
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(num_experts):
        layers = []
        for fan_in, fan_out in ((hidden, ffn), (ffn, hidden)):
            lin = torch.nn.Linear(fan_in, fan_out, device=CPU, dtype=F64)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(fan_out, fan_in, generator=gen, dtype=F64, device=CPU) / fan_in ** 0.5)
                lin.bias.copy_(0.1 * torch.randn(fan_out, generator=gen, dtype=F64, device=CPU))
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


# ----------------------------------------------------------------------------- comparisons
def err(what, got, want) -> str | None:
    """Why ``got`` is not ``want`` (None if it is: exact for integers and booleans, else within TOL
    relative to the values' scale)."""
    if got is None:
        return f"{what} is None: no gradient reached it (was it detached, or built outside autograd?)"
    if problem := not_plain_tensor(what, got, want.shape):
        return problem
    got = got.detach().to(CPU)
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if want.dtype.is_floating_point != got.dtype.is_floating_point:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    if not want.dtype.is_floating_point:
        if torch.equal(got.to(want.dtype), want):
            return None
        show = lambda x: x.tolist() if x.numel() <= 24 else f"a tensor of {x.numel()} other values"     # noqa: E731
        return f"{what} is {show(got)}; expected {show(want)}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype} (the inputs' dtype)"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= TOL * scale:
        return f"{what} differs from one process (max |error| {diff:.3g}, scale {scale:.3g})"
    return None


def unchanged(what, tensor, original) -> str | None:
    if not torch.equal(tensor.detach().to(CPU), original):
        return f"{what} was modified in place: the caller's tensor must stay as it was"
    return None


def traffic(tr) -> Counter:
    """(kind, bytes) of every traced all-to-all (the tracer counts an all-to-all's whole input)."""
    return Counter(("all-to-all" if e.op in ("all_to_all_single", "all_to_all") else e.op, e.nbytes)
                   for e in tr.comm())


def show(c: Counter) -> str:
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def compare(tr, want: list, phase: str) -> str | None:
    got, want = traffic(tr), Counter(("all-to-all", b) for b in want)
    return None if got == want else f"{phase} communicated {show(got)}; expected {show(want)}"


def raises(fn, args, what, kwargs=None) -> list:
    """The call must raise ValueError before any communication."""
    try:
        with trace() as tr:
            fn(*args, **(kwargs or {}))
    except ValueError:
        return [None if not tr.comm() else f"raised ValueError only after communicating: check {what} first, "
                "before any message (the other ranks would wait for you)"]
    except Exception as other:      # noqa: BLE001  (the student's error, named)
        return [f"raised {type(other).__name__} ({str(other)[:120]}) although {what}; the lab asks for a ValueError "
                "with a clear message, before any message"]
    return [f"returned although {what}; the lab asks for a ValueError"]


# ----------------------------------------------------------------------------- expected traffic
def expected(name, sent, received, num_experts, t, elem_bytes, phase) -> list:
    """Payload bytes of ``name``'s all-to-alls in ``phase``, from :func:`cost.ep_collectives` (a layer's five:
    forward counts, dispatch A rows, combine R rows; backward combine's A rows, dispatch's R rows)."""
    layer = [c.nbytes for c in cost.ep_collectives(sent, received, HID, num_experts, t, elem_bytes) if c.phase == phase]
    if name == "ep_dispatch":
        return layer[:2] if phase == "forward" else layer[1:]
    if name == "ep_combine":
        return layer[2:] if phase == "forward" else layer[:1]
    return layer


def _device(x):
    """A copy of ``x`` on the rank's device (never ``x`` itself: the references keep theirs untouched)."""
    return x.detach().to(minidist.device(), copy=True)


# ----------------------------------------------------------------------------- one runner per function
def case_dispatch(fn, case, r, t, group):
    num_experts, k, dtype = case["E"], case["k"], case["dtype"]
    toks = [randn((tokens_of(s), HID), 10 + s, dtype) for s in range(t)]
    if case.get("raises"):
        idx = torch.zeros(tokens_of(r) + (case["raises"] == "rows"), k, dtype=torch.long, device=CPU)
        what = (f"{num_experts} experts do not split over {t} ranks" if case["raises"] == "split"
                else "expert_indices has a row more than there are tokens")
        return raises(fn, (_device(toks[r]), _device(idx), num_experts, group), what)
    picks = [choices(case, s, t) for s in range(t)]
    p = ref.plan(picks, num_experts)
    x = _device(toks[r]).requires_grad_()
    given, idx = x * 1, _device(picks[r])
    with trace() as tf:
        result = fn(given, idx, num_experts, group)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return ["ep_dispatch must return (expert_inputs, route)"]
    rows, route = result
    want_rows = torch.stack([toks[s][q // k] for s, q in zip(p.src[r].tolist(), p.pair[r].tolist())]) \
        if len(p.src[r]) else toks[r].new_zeros(0, HID)
    errs = [err("expert_inputs", rows, want_rows), unchanged("expert_indices", idx, picks[r]),
            unchanged("tokens", given, toks[r])]
    want_route = p.routes[r]
    for field in ref.Route._fields:
        got = getattr(route, field, None)
        if isinstance(got, torch.Tensor) and field == "recv_counts":
            got = got.reshape(t, -1)
        errs.append(err(f"route.{field}", got, getattr(want_route, field)))
    if any(errs):
        return errs
    ups = [randn((len(p.src[d]), HID), 20 + d, dtype) for d in range(t)]
    with trace() as tb:
        (rows * _device(ups[r])).sum().backward()
    want_grad = toks[r].new_zeros(tokens_of(r), HID)
    for d in range(t):
        mine = p.src[d] == r
        want_grad.index_add_(0, p.pair[d][mine] // k, ups[d][mine])
    errs.append(err("tokens.grad", x.grad, want_grad))
    if t > 1 and not any(errs):
        el, sent, got = toks[r].element_size(), len(want_route.order), len(p.src[r])
        errs += [compare(tf, expected("ep_dispatch", sent, got, num_experts, t, el, "forward"), "forward"),
                 compare(tb, expected("ep_dispatch", sent, got, num_experts, t, el, "backward"), "backward")]
    return errs


def case_combine(fn, case, r, t, group):
    num_experts, k, dtype = case["E"], case["k"], case["dtype"]
    picks = [choices(case, s, t) for s in range(t)]
    p = ref.plan(picks, num_experts)
    outs = [randn((len(p.src[d]), HID), 30 + d, dtype).requires_grad_() for d in range(t)]
    ws = [randn((tokens_of(s), k), 40 + s, dtype).abs().requires_grad_() for s in range(t)]
    ups = [randn((tokens_of(s), HID), 50 + s, dtype) for s in range(t)]
    total = 0
    for s in range(t):               # the reference: every rank's tokens, in one process
        y = outs[s].new_zeros(tokens_of(s), HID)
        for d in range(t):
            mine = p.src[d] == s
            pairs = p.pair[d][mine]
            y = y.index_add(0, pairs // k, outs[d][mine] * ws[s].reshape(-1)[pairs, None])
        if s == r:
            want_y = y.detach()
        total = total + (y * ups[s]).sum()
    total.backward()
    eo, w = _device(outs[r].detach()).requires_grad_(), _device(ws[r].detach()).requires_grad_()
    route = ref.Route(*(_device(x) for x in p.routes[r]))
    given = (eo * 1, w * 1)
    with trace() as tf:
        y = fn(*given, route, group)
    errs = [err("the output", y, want_y), unchanged("expert_outputs", given[0], outs[r].detach()),
            unchanged("weights", given[1], ws[r].detach())]
    if any(errs):
        return errs
    with trace() as tb:
        (y * _device(ups[r])).sum().backward()
    errs += [err("expert_outputs.grad", eo.grad, outs[r].grad), err("weights.grad", w.grad, ws[r].grad)]
    if t > 1 and not any(errs):
        el, sent, got = outs[r].element_size(), len(p.routes[r].order), len(p.src[r])
        errs += [compare(tf, expected("ep_combine", sent, got, num_experts, t, el, "forward"), "forward"),
                 compare(tb, expected("ep_combine", sent, got, num_experts, t, el, "backward"), "backward")]
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


def case_moe(fn, case, r, t, group):
    num_experts, k, dtype, cf = case["E"], case["k"], case["dtype"], case.get("capacity")
    w, xs = _moe_inputs(case, t)
    local = max(1, num_experts // t)
    experts = make_experts(num_experts, seed=3, dtype=dtype)[r * local:(r + 1) * local]
    if case.get("raises"):
        bad = case["raises"]
        args = (_device(xs[r]), _device(w if bad != "shape" else torch.cat([w, w[:1]])), experts,
                k if bad != "k" else num_experts + 1, group)
        what = {"split": f"{num_experts} experts do not split over {t} ranks", "k": f"k > E = {num_experts}",
                "capacity": f"capacity_factor = {cf}", "shape": "router_weight has a row more than the tokens' size"}
        return raises(fn, args, what[bad], dict(capacity_factor=cf))
    reference = make_experts(num_experts, seed=3, dtype=dtype, device=CPU)
    ups = [randn((tokens_of(s), HID), 80 + s, dtype) for s in range(t)]
    total, want = 0, None
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
        if s == r:
            want, sent = (y, aux, x, ws), int(keep.sum())
    total.backward()
    x, wr = _device(xs[r]).requires_grad_(), _device(w).requires_grad_()
    given = (x * 1, wr * 1)
    with trace() as tf:
        result = fn(*given, experts, k, group, capacity_factor=cf)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return ["moe_layer must return (output, load-balancing loss)"]
    y, aux = result
    errs = [err("the output", y, want[0].detach()), err("the load-balancing loss", aux, want[1].detach()),
            unchanged("x", given[0], xs[r]), unchanged("router_weight", given[1], w)]
    if any(errs):
        return errs
    with trace() as tb:
        ((y * _device(ups[r])).sum() + AUX * aux).backward()
    errs += [err("x.grad", x.grad, want[2].grad), err("router_weight.grad", wr.grad, want[3].grad)]
    for j, expert in enumerate(experts):
        for (name, param), theirs in zip(expert.named_parameters(), reference[r * local + j].parameters()):
            errs.append(err(f"local expert {j} (expert {r * local + j}) {name}.grad", param.grad, theirs.grad))
    if t > 1 and not any(errs):
        el = xs[r].element_size()
        got = _received(case, xs, w, t, r, k, cf)
        errs += [compare(tf, expected("moe_layer", sent, got, num_experts, t, el, "forward"), "forward"),
                 compare(tb, expected("moe_layer", sent, got, num_experts, t, el, "backward"), "backward")]
    return errs


def _received(case, xs, w, t, r, k, cf) -> int:
    """Rows group rank r's experts receive: every rank's kept choices of r's experts."""
    local = case["E"] // t
    got = 0
    for s in range(t):
        idx, _, keep = ref.top_k_router(xs[s] @ w, k, cf)
        got += int(((idx // local == r) & keep).sum())
    return got


CASE_RUNNERS = {"ep_dispatch": case_dispatch, "ep_combine": case_combine, "moe_layer": case_moe}
