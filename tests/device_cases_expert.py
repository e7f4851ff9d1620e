"""Device-discipline cases for expert parallelism (see tests/device_discipline.py): the router,
its losses, dispatch/combine, the MoE layer, the DP × EP mesh and its harness.

Every body runs inside a rank of one 4-rank launch, inputs made on ``minidist.device()``
while torch's default device is ``meta``. Each runs forward and, where there is one, backward
(the custom backward of ``AllToAllRows`` included) and compares with a reference
from plain torch ops computed in the same rank: a per-token loop over every rank's tokens
(drawn from seeds every rank knows), so each rank knows what its experts must receive.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from device_discipline import Case, assert_real
from minidist import expert_parallel as ep
from minidist.harness import expert_parallel as hep

WORLD = 4
E, H, FF, T = 4, 6, 8, 5


def dev() -> torch.device:
    return minidist.device()


def randn(*shape, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype, device="cpu").to(dev())


def close(got, want, tol: float = 1e-10, what: str = "result") -> None:
    assert_real(got, want)
    assert got.device == want.device == dev(), f"{what} is on {got.device}, expected {dev()}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got.detach().double() - want.detach().double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:g}"


def rank_n() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _loop_moe(x, router, experts, k):
    """Plain per-token MoE, dropless: Σ_j w_j expert_j(x_t), w the renormalised top-k softmax."""
    rows = []
    for t in range(x.shape[0]):
        p = torch.softmax(x[t] @ router.t(), -1)
        top, idx = p.topk(k)
        top = top / top.sum()
        rows.append(sum(top[j] * experts[int(idx[j])](x[t:t + 1])[0] for j in range(k)))
    return torch.stack(rows)


def _expert(j):
    (mlp,) = ep.make_experts(H, FF, [j], seed=0, device=dev(), dtype=torch.float64)
    return mlp


# ----------------------------------------------------------------------------- router and losses
def case_top_k_router():
    logits = randn(T, E, seed=1).requires_grad_()
    r = ep.top_k_router(logits, 2, capacity_factor=0.5)
    p = torch.softmax(logits, -1)
    top, idx = p.topk(2)
    assert torch.equal(r.indices, idx) and r.mask.device == dev() and r.mask.dtype == torch.bool
    close(r.weights, top / top.sum(-1, keepdim=True))
    r.weights.sum().backward()
    assert_real(logits.grad)
    assert int(r.mask.sum()) <= E * r.capacity
    assert bool(ep.top_k_router(logits, 1).mask.all())


def case_load_balancing_loss():
    logits = randn(T, E, seed=2).requires_grad_()
    p = torch.softmax(logits, -1)
    idx = p.topk(2).indices
    loss = ep.load_balancing_loss(p, idx, E)
    f = F.one_hot(idx.reshape(-1), E).double().mean(0)
    close(loss, E * (f * p.mean(0)).sum())
    loss.backward()
    assert logits.grad.device == dev()


def case_router_z_loss():
    logits = randn(T, E, seed=3).requires_grad_()
    z = ep.router_z_loss(logits)
    close(z, (logits.exp().sum(-1).log() ** 2).mean())
    z.backward()
    assert logits.grad.device == dev()


def case_tokens_per_expert():
    idx = torch.tensor([[0, 1], [1, 3]], device=dev())
    got = ep.tokens_per_expert(idx, E, mask=torch.tensor([[True, True], [False, True]], device=dev()))
    assert got.device == dev() and got.tolist() == [1, 1, 0, 1]


# ----------------------------------------------------------------------------- dispatch and combine
def _dispatch_roundtrip(use_exchange: bool):
    """Every rank's token t goes to experts (t + rank) % E and (t + rank + 1) % E; experts double
    the rows; combine with weights w must give 2·(w0 + w1)·x, gradients 2·(w0 + w1)."""
    rank, n = rank_n()
    x = randn(T, H, seed=10 + rank).requires_grad_()
    idx = torch.stack([(torch.arange(T, device=dev()) + rank + j) % E for j in range(2)], 1)
    w = randn(T, 2, seed=20 + rank).abs().requires_grad_()
    if use_exchange:                      # the exchange itself, out and back, around a dispatch's plan
        _, plan = ep.ep_dispatch(x.detach(), idx, E)
        rows = ep.all_to_all_rows(x[plan.token_index], plan.send_splits, plan.recv_splits)
        back = ep.AllToAllRows.apply(rows * 2, plan.recv_splits, plan.send_splits, None)
        y = torch.zeros(T, H, dtype=x.dtype, device=dev()).index_add(0, plan.token_index, back)
        want_factor = torch.full((T, 1), 4.0, dtype=x.dtype, device=dev())
    else:
        rows, plan = ep.ep_dispatch(x, idx, E)
        y = ep.ep_combine(rows * 2, w, plan)
        want_factor = 2 * w.detach().sum(1, keepdim=True)
    close(y, want_factor * x.detach())
    mine = set(range(rank * E // n, (rank + 1) * E // n))
    assert sum(plan.tokens_per_expert) == sum(int((i + r + j) % E in mine) for r in range(n) for i in range(T)
                                               for j in range(2))
    y.sum().backward()
    close(x.grad, want_factor.expand(T, H))
    if not use_exchange:
        close(w.grad, 2 * x.detach().sum(1, keepdim=True).expand(T, 2), what="weights' gradient")


def case_ep_dispatch():
    _dispatch_roundtrip(False)


def case_ep_combine():
    _dispatch_roundtrip(False)


def case_all_to_all_rows():
    _dispatch_roundtrip(True)


def case_AllToAllRows():
    _dispatch_roundtrip(True)


def case_within_capacity():
    got = ep.within_capacity(torch.tensor([0, 1, 0, 0, 2, 1], device=dev()), 3, 2)
    assert got.device == dev() and got.tolist() == [True, True, True, False, True, True]


def case_simulate_dispatch():
    """Every rank's dispatch simulated in one process equals what this rank's ep_dispatch gets."""
    rank, n = rank_n()
    xs = [randn(T + s, H, seed=40 + s) for s in range(n)]
    idxs = [torch.stack([(torch.arange(T + s, device=dev()) * (s + 1) + j) % E for j in range(2)], 1)
            for s in range(n)]
    masks = [torch.arange(2 * (T + s), device=dev()).reshape(T + s, 2) % 3 != 0 for s in range(n)]
    sim = ep.simulate_dispatch(idxs, E, masks)[rank]
    rows, plan = ep.ep_dispatch(xs[rank], idxs[rank], E, masks[rank])
    assert sim.source.device == sim.pair.device == sim.plan.order.device == dev()
    assert torch.equal(sim.plan.pairs, plan.pairs) and torch.equal(sim.plan.recv_counts, plan.recv_counts)
    close(torch.stack([xs[s][p // 2] for s, p in zip(sim.source.tolist(), sim.pair.tolist())]), rows)


# ----------------------------------------------------------------------------- layer
def _all_tokens(n):
    return torch.cat([randn(T, H, seed=30 + r) for r in range(n)])


def _layer_vs_loop(run):
    rank, n = rank_n()
    router = ep.make_router_weight(H, E, seed=0, device=dev(), dtype=torch.float64)
    assert router.device == dev()
    full = [_expert(j) for j in range(E)]
    x = randn(T, H, seed=30 + rank).requires_grad_()
    y, local = run(x, router)
    close(y, _loop_moe(x.detach(), router, full, 2), what="MoE output")
    y.sum().backward()
    assert x.grad.device == dev()
    for m in local:
        for p in m.parameters():
            assert p.grad is not None and p.grad.device == dev()


def case_moe_layer():
    def run(x, router):
        local = ep.make_experts(H, FF, ep.local_expert_range(E), device=dev(), dtype=torch.float64)
        return ep.moe_layer(x, router, local, 2), local
    _layer_vs_loop(run)


def case_run_experts():
    def run(x, router):
        local = ep.make_experts(H, FF, ep.local_expert_range(E), device=dev(), dtype=torch.float64)
        r = ep.top_k_router(x @ router.t(), 2)
        rows, plan = ep.ep_dispatch(x, r.indices, E, r.mask)
        return ep.ep_combine(ep.run_experts(rows, plan.tokens_per_expert, local), r.weights, plan), local
    _layer_vs_loop(run)


def case_make_experts():
    case_moe_layer()


def case_make_router_weight():
    case_moe_layer()


def case_MoELayer():
    layer = ep.MoELayer(H, FF, E, k=2, balance_coef=0.1, z_coef=0.01, device=dev(), dtype=torch.float64)
    for p in layer.parameters():
        assert p.device == dev()
    rank, _ = rank_n()
    x = randn(T, H, seed=30 + rank).requires_grad_()
    y, aux = layer(x)
    full = [_expert(j) for j in range(E)]
    close(y, _loop_moe(x.detach(), layer.router.detach(), full, 2))
    (y.sum() + aux).backward()
    assert layer.router.grad.device == dev() and x.grad.device == dev()


def case_ExpertMLP():
    m = ep.ExpertMLP(H, FF, device=dev(), dtype=torch.float64)
    x = randn(T, H, seed=4).requires_grad_()
    y = m(x)
    close(y, F.linear(F.gelu(F.linear(x, m.fc.weight, m.fc.bias)), m.proj.weight, m.proj.bias))
    y.sum().backward()
    assert m.fc.weight.grad.device == dev()


def case_moe_reference():
    router = ep.make_router_weight(H, E, seed=0, device=dev(), dtype=torch.float64)
    full = [_expert(j) for j in range(E)]
    x = _all_tokens(2).requires_grad_()
    y, routings = ep.moe_reference(x, router, full, 2, groups=2)
    close(y, _loop_moe(x.detach(), router, full, 2))
    assert len(routings) == 2 and routings[0].indices.device == dev()
    y.sum().backward()
    assert x.grad.device == dev()


# ----------------------------------------------------------------------------- DP × EP
def _moe_step():
    ep_group, edp_group = ep.new_ep_dp_groups(2)
    layer = ep.MoELayer(H, FF, E, k=1, group=ep_group, device=dev(), dtype=torch.float64)
    rank, _ = rank_n()
    y, aux = layer(randn(T, H, seed=30 + rank))
    (y.square().sum() + aux).backward()
    return layer, ep_group, edp_group


def case_new_ep_dp_groups():
    layer, ep_group, edp_group = _moe_step()
    rank, _ = rank_n()
    assert dist.get_process_group_ranks(ep_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(edp_group) == [rank % 2, rank % 2 + 2]


def case_expert_parameters():
    layer, _, _ = _moe_step()
    got = ep.expert_parameters(layer)
    assert len(got) == 4 * E // 2 and all(p.device == dev() and p.grad.device == dev() for p in got)


def case_dense_parameters():
    layer, _, _ = _moe_step()
    assert ep.dense_parameters(layer) == [layer.router]


def case_sync_moe_gradients():
    layer, _, edp_group = _moe_step()
    before = {id(p): p.grad.clone() for p in layer.parameters()}
    ep.sync_moe_gradients(layer, edp_group)
    router = before[id(layer.router)].clone()
    dist.all_reduce(router)
    close(layer.router.grad, router / WORLD, what="router gradient")
    for p in ep.expert_parameters(layer):
        want = before[id(p)].clone()
        dist.all_reduce(want, group=edp_group)
        close(p.grad, want / WORLD, what="expert gradient")


# ----------------------------------------------------------------------------- harness
CASE = hep.MoECase(hidden=6, ffn=8, num_experts=4, tokens=4, steps=1)


def case_train_dp_ep():
    ours = hep.train_dp_ep(CASE, 2)
    ref = hep.reference_train(CASE, WORLD)
    assert hep.max_param_error(ours["params"], ref["params"]) <= 1e-12
    assert abs(ours["losses"][0] - ref["losses"][0]) <= 1e-12


def case_reference_train():
    ref = hep.reference_train(CASE, 2)
    assert len(ref["params"]) == 3 + 4 * CASE.num_experts and ref["losses"][0] == ref["losses"][0]


def case_max_param_error():
    a = {"w": torch.ones(2, device=dev())}
    assert hep.max_param_error(a, {"w": torch.zeros(2, device=dev())}) == 1.0


def case_TinyMoE():
    model = hep.TinyMoE(CASE, None)
    x, target = hep.moe_batch(CASE, 0, 1)
    assert x.device == dev() and all(p.device == dev() for p in model.parameters())
    out, aux = model(x)
    (F.mse_loss(out, target) + aux).backward()
    assert model.inp.weight.grad.device == dev()


def case_moe_batch():
    x, y = hep.moe_batch(CASE, 1, 2)
    assert x.device == y.device == dev() and x.shape == (2 * CASE.tokens, CASE.hidden)
    assert_real(x, y)


CASES = {f"minidist.{name}": Case(WORLD, body) for name, body in {
    "expert_parallel.top_k_router": case_top_k_router, "expert_parallel.load_balancing_loss": case_load_balancing_loss,
    "expert_parallel.router_z_loss": case_router_z_loss, "expert_parallel.tokens_per_expert": case_tokens_per_expert,
    "expert_parallel.ep_dispatch": case_ep_dispatch, "expert_parallel.ep_combine": case_ep_combine,
    "expert_parallel.all_to_all_rows": case_all_to_all_rows, "expert_parallel.AllToAllRows": case_AllToAllRows,
    "expert_parallel.within_capacity": case_within_capacity,
    "expert_parallel.simulate_dispatch": case_simulate_dispatch,
    "expert_parallel.moe_layer": case_moe_layer, "expert_parallel.run_experts": case_run_experts,
    "expert_parallel.make_experts": case_make_experts, "expert_parallel.make_router_weight": case_make_router_weight,
    "expert_parallel.MoELayer": case_MoELayer, "expert_parallel.ExpertMLP": case_ExpertMLP,
    "expert_parallel.moe_reference": case_moe_reference,
    "expert_parallel.new_ep_dp_groups": case_new_ep_dp_groups,
    "expert_parallel.expert_parameters": case_expert_parameters,
    "expert_parallel.dense_parameters": case_dense_parameters,
    "expert_parallel.sync_moe_gradients": case_sync_moe_gradients,
    "harness.expert_parallel.train_dp_ep": case_train_dp_ep,
    "harness.expert_parallel.reference_train": case_reference_train,
    "harness.expert_parallel.max_param_error": case_max_param_error,
    "harness.expert_parallel.TinyMoE": case_TinyMoE, "harness.expert_parallel.moe_batch": case_moe_batch,
}.items()}

_PURE = "pure arithmetic on ints (no tensor, no process group)"
EXEMPT = {
    "minidist.expert_parallel.Routing": "a named tuple of the router's tensors (made by top_k_router, covered)",
    "minidist.expert_parallel.DispatchPlan": "a dataclass of ep_dispatch's index tensors (made there, covered)",
    "minidist.expert_parallel.SimulatedDispatch": "a named tuple of simulate_dispatch's tensors (made there, covered)",
    "minidist.expert_parallel.expert_capacity": _PURE,
    "minidist.expert_parallel.check_moe_sizes": "validation of sizes: ints only",
    "minidist.expert_parallel.expert_owner": _PURE,
    "minidist.expert_parallel.local_expert_range": "a range of ints from the group's rank and size",
    "minidist.expert_parallel.ep_dp_groups": _PURE,
    "minidist.harness.expert_parallel.MoECase": "a frozen dataclass of sizes",
    "minidist.harness.expert_parallel.expected_traffic": "the cost model's numbers (ints, no tensor)",
}
