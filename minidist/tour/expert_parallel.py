"""``minidist tour`` rows for expert parallelism: dispatch/combine, the MoE layer, the DP × EP step.

Each row runs on 4 CPU ranks (E = 8 experts, 2 per rank in an EP group of 4, unless the
row says otherwise), inputs drawn on the CPU from a seed and moved to ``minidist.device()``:

* the dispatch/combine round trip with a round-robin router (every expert chosen equally
  often on every rank): experts that double their rows, so combine must give 2·Σ w · x;
  traced bytes equal :func:`minidist.cost.ep_layer_collectives`, the balanced-routing theory;
* the MoE layer (k = 2, capacity factor 1.0, so some tokens are dropped) forward and
  backward next to :func:`~minidist.expert_parallel.moe_reference` on one process (every
  rank's block routed on its own): max_err over the output, the input's, the router's and
  every expert's gradient; traced bytes equal :func:`minidist.cost.ep_collectives` for the
  rows each rank sent and received (counted from the reference's routing);
* a skewed router (every token's first choice in the first rank's experts), dropless: the
  same equality, and the load imbalance over the EP ranks measured next to the formula;
* a DP 2 × EP 2 training step of ``harness.expert_parallel.TinyMoE`` (2 SGD steps, fp64)
  next to one process: parameters, losses, and the step's all-reduces and all-to-alls.

A row's own ``passed`` says the traced bytes equal the cost model on every rank; the tour judges max_err.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import cost
from minidist.expert_parallel import (ep_combine, ep_dispatch, local_expert_range, make_experts, make_router_weight,
                                      moe_layer, moe_reference, top_k_router)
from minidist.harness.expert_parallel import MoECase, expected_traffic, max_param_error, reference_train, train_dp_ep
from minidist.runtime import device, launch, timed
from minidist.tour import TourEntry
from minidist.trace import trace

P, E, H, F, T = 4, 8, 16, 32, 16


def _err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item() if b.numel() else 0.0


def _draw(seed, *shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64, device="cpu").to(device(), dtype)


def _a2a(t) -> int:
    return sum(e.nbytes for e in t.comm() if e.op == "all_to_all_single")


def _roundtrip():
    r = dist.get_rank()
    k = 2
    indices = torch.stack([(torch.arange(T, device=device()) + r + j) % E for j in range(k)], 1)
    x, w = _draw(r, T, H).requires_grad_(), _draw(10 + r, T, k).abs()
    with trace() as t:
        rows, plan = ep_dispatch(x, indices, E)
        y = ep_combine(2 * rows, w, plan)
        y.sum().backward()
    want = 2 * w.sum(1, keepdim=True) * x.detach()
    err = max(_err(y, want), _err(x.grad, 2 * w.sum(1, keepdim=True).expand(T, H)))
    return err, _a2a(t), cost.tp_payload_bytes(cost.ep_layer_collectives(T, H, k, E, P))


def _layer(k, cf, skew):
    r = dist.get_rank()
    x_all, up = _draw(1, P * T, H), _draw(2, P * T, H)
    router = make_router_weight(H, E, seed=0, device=device())
    if skew:                                  # positive tokens, large positive rows for the first rank's experts
        x_all = x_all.abs() + 1
        router[:E // P] += 1.0
    xr, wr = x_all.clone().requires_grad_(), router.clone().requires_grad_()
    full = make_experts(H, F, range(E), device=device())
    yr, routings = moe_reference(xr, wr, full, k, cf, groups=P)
    (yr * up).sum().backward()
    mine = slice(r * T, (r + 1) * T)
    x, w = x_all[mine].clone().requires_grad_(), router.clone().requires_grad_()
    ids = local_expert_range(E)
    local = make_experts(H, F, ids, device=device())
    with trace() as t:
        y = moe_layer(x, w, local, k, cf)
        (y * up[mine]).sum().backward()
    w_grad = w.grad.clone()
    dist.all_reduce(w_grad)
    err = max(_err(y, yr[mine]), _err(x.grad, xr.grad[mine]), _err(w_grad, wr.grad),
              max(_err(p.grad, q.grad) for j, m in zip(ids, local)
                  for p, q in zip(m.parameters(), full[j].parameters())))
    sent = int(routings[r].mask.sum())
    received = sum(int((rt.indices[rt.mask] // (E // P) == r).sum()) for rt in routings)
    theory = cost.tp_payload_bytes(cost.ep_collectives(sent, received, H, E, P))
    per_expert = sum(top_k_router(x_all[b * T:(b + 1) * T] @ router.t(), k, cf).indices.reshape(-1)
                     .bincount(minlength=E) for b in range(P)).tolist()
    return err, _a2a(t), theory, per_expert, sum(int((~rt.mask).sum()) for rt in routings)


def _step():
    case = MoECase(capacity_factor=1.0)
    ours, ref = train_dp_ep(case, 2), reference_train(case, P)
    err = max(max_param_error(ours["params"], ref["params"]),
              max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])))
    want = expected_traffic(case, 2, P, ours["rows"])
    return err, sum(b for *_, b in ours["traffic"]), sum(b for *_, b in want), ours["traffic"] == want


ROWS = {
    "EP dispatch/combine round trip (E=8 on 4 ranks, k=2)": "roundtrip",
    "EP MoE layer vs one process (k=2, capacity 1.0, drops)": "layer",
    "EP MoE layer, skewed router (k=1, dropless)": "skew",
    "DP 2 x EP 2 training step vs one process": "step",
}


def _rank(kind):
    if kind == "roundtrip":
        return _roundtrip()
    if kind == "step":
        return _step()
    return _layer(2, 1.0, False) if kind == "layer" else _layer(1, None, True)


def tour_row(label: str) -> dict:
    kind = ROWS[label]
    with timed() as clock:
        out = launch(_rank, P, kind, timeout=120)
    busiest = max(range(P), key=lambda i: out[i][1])
    row = {"technique": label, "world_size": P, "max_err": max(o[0] for o in out),
           "bytes_per_rank": out[busiest][1], "bytes_theory": out[busiest][2], "time_s": clock.seconds}
    if kind == "step":
        row["passed"] = all(o[3] for o in out)
        row["tolerance"] = 1e-12
        row["note"] = ("fp64; dense grads all-reduced over 4 ranks, experts' over their 2 replicas; "
                       "all-to-alls inside each EP pair")
        return row
    row["passed"] = all(o[1] == o[2] for o in out)
    if kind == "roundtrip":
        row["note"] = "balanced router: counts, then one uneven all-to-all each way, forward and backward"
    else:
        loads = out[0][3]
        spread = cost.expert_load_imbalance(loads, P)
        row["load_imbalance"] = spread
        row["note"] = (f"choices per expert {loads}; rows per EP rank max/mean {spread:.2f}"
                       + (f"; {out[0][4]} of {P * T * 2} choices dropped" if kind == "layer" else ""))
        if kind == "skew":
            row["passed"] = row["passed"] and spread > 1.5
    return row


def tour_entries() -> list[TourEntry]:
    return [TourEntry(label, P, lambda k=label: tour_row(k)) for label in ROWS]
