"""Expert parallelism (minidist.expert_parallel), measured against one process.

Every distributed case runs inside ONE 4-rank ``minidist.launch`` (cached): EP groups of
e = 1, 2, 4 consecutive ranks (``consecutive_groups``), the DP × EP step on the (dp, ep)
meshes of the whole world. Each rank computes the single-process reference itself
(``moe_reference`` with all E experts, each rank's block of tokens routed on its own),
runs the EP version on its block, and returns numbers; the tests assert on them:

* output, input gradient, router gradient (summed over the group) and every local expert's
  gradients equal one process, fp64 within 1e-12 and fp32 within 1e-5, for e = 1, 2, 4,
  k = 1, 2, dropless and with capacity factor 0.5 (tokens dropped);
* experts that receive no token on any rank (a router that sends everything to expert 0);
* the whole group's dispatch simulated in one process (``simulate_dispatch``) equals every rank's
  ``ep_dispatch``: plan and rows, uneven token counts and dropped choices;
* traced all-to-all payloads equal ``cost.ep_collectives`` exactly (rows counted from the
  reference's routing of every rank's block), and for balanced routing ``cost.ep_layer_collectives``;
* a DP × EP training step (dp × ep = 4 × 1, 2 × 2, 1 × 4) equals one process's parameters
  and losses; the gradient all-reduces go over the groups the mesh says;
* every ValueError is raised before any collective.
Pure parts (router priority, losses, cost formulas, the planner's EP layouts) run without ranks.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

import minidist
from conftest import attempt
from minidist import cost
from minidist.checks.kit.groups import consecutive_groups
from minidist.expert_parallel import (all_to_all_rows, ep_combine, ep_dispatch, ep_dp_groups, expert_capacity,
                                      load_balancing_loss, local_expert_range, make_experts, make_router_weight,
                                      moe_layer, moe_reference, router_z_loss, simulate_dispatch, tokens_per_expert,
                                      top_k_router)
from minidist.harness.expert_parallel import MoECase, expected_traffic, max_param_error, reference_train, train_dp_ep
from minidist.runtime.device import visible_gpus
from minidist.trace import trace

E, H, F, T = 4, 6, 8, 8             # experts, hidden, expert ffn, tokens per rank
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
WORLD = 4


# ============================================================================= rank side
def _err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item() if b.numel() else 0.0


def _layer_case(group, k, cf, dtype, skew=False, seed=0):
    """One MoE layer forward + backward on this rank's block vs moe_reference on all blocks."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(n * T, H, generator=g, dtype=torch.float64).to(dtype)
    up = torch.randn(n * T, H, generator=g, dtype=torch.float64).to(dtype)
    router = make_router_weight(H, E, seed, device="cpu", dtype=dtype)
    if skew:                           # positive tokens, a large positive row: every token picks expert 0
        x_all, router = x_all.abs() + 1, router.clone()
        router[0] = 10.0
    xr, wr = x_all.clone().requires_grad_(), router.clone().requires_grad_()
    full = make_experts(H, F, range(E), seed, device="cpu", dtype=dtype)
    yr, routings = moe_reference(xr, wr, full, k, cf, groups=n)
    (yr * up).sum().backward()
    mine = slice(r * T, (r + 1) * T)
    x, w = x_all[mine].clone().requires_grad_(), router.clone().requires_grad_()
    ids = local_expert_range(E, group)
    local = make_experts(H, F, ids, seed, device="cpu", dtype=dtype)
    with trace() as t:
        y = moe_layer(x, w, local, k, cf, group=group)
        (y * up[mine]).sum().backward()
    w_grad = w.grad.clone()
    if n > 1:
        dist.all_reduce(w_grad, group=group)
    expert_err = max(_err(p.grad, q.grad) for j, m in zip(ids, local)
                     for p, q in zip(m.parameters(), full[j].parameters()))
    sent = int(routings[r].mask.sum())
    received = sum(int((rt.indices[rt.mask] // (E // n) == r).sum()) for rt in routings)
    empty = [j for j in range(E) if not any(int(((rt.indices == j) & rt.mask).sum()) for rt in routings)]
    return {"out": _err(y, yr[mine]), "dx": _err(x.grad, xr.grad[mine]), "drouter": _err(w_grad, wr.grad),
            "experts": expert_err, "traced": sorted(e.nbytes for e in t.comm() if e.op == "all_to_all_single"),
            "ops": sorted({e.op for e in t.comm()}), "sent": sent, "received": received, "empty": empty,
            "dropped": sum(int((~rt.mask).sum()) for rt in routings),
            "zero_grads": all(float(p.grad.abs().max()) == 0 for j, m in zip(ids, local) if j in empty
                              for p in m.parameters())}


def _balanced_case(group, k, cf):
    """Round-robin routing (every expert chosen T·k/E times per rank): traced bytes vs the theory."""
    n = dist.get_world_size(group)
    logits = torch.zeros(T, E, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            logits[t, (t + j) % E] = k - j + 1.0
    routing = top_k_router(logits, k, cf)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    with trace() as tr:
        rows, plan = ep_dispatch(x, routing.indices, E, routing.mask, group=group)
        back = ep_combine(rows * 2, torch.ones(T, k, dtype=torch.float64), plan, group=group)
        back.sum().backward()
    want = torch.zeros_like(x).index_add(0, plan.token_index, 2 * x[plan.token_index].detach())
    return {"traced": sorted(e.nbytes for e in tr.comm()), "roundtrip": _err(back, want),
            "theory": sorted(c.nbytes for c in cost.ep_layer_collectives(T, H, k, E, n, cf, elem_bytes=8)),
            "tokens_per_expert": plan.tokens_per_expert}


def _simulated_case(group, k=2):
    """This rank's ep_dispatch next to the whole group's dispatch simulated in one process: group rank
    s holds T + s tokens, random choices, a third of them dropped (all of group rank 1's)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    xs, idxs, masks = [], [], []
    for s in range(n):
        g = torch.Generator().manual_seed(50 + s)
        xs.append(torch.randn(T + s, H, generator=g, dtype=torch.float64))
        idxs.append(torch.rand(T + s, E, generator=g).argsort(-1)[:, :k])
        masks.append((torch.rand(T + s, k, generator=g) > 0.35) & (s != 1))
    sim = simulate_dispatch(idxs, E, masks)[r]
    rows, plan = ep_dispatch(xs[r], idxs[r], E, masks[r], group=group)
    want = torch.stack([xs[s][p // k] for s, p in zip(sim.source.tolist(), sim.pair.tolist())]) if len(sim.pair) \
        else xs[r][:0]
    same = {f: torch.equal(getattr(plan, f), getattr(sim.plan, f)) for f in ("pairs", "send_counts", "recv_counts",
                                                                             "order", "by_source", "token_index")}
    return {"same": same, "rows": torch.equal(rows, want), "splits": plan.recv_splits == sim.plan.recv_splits,
            "received": len(sim.pair), "sent_by_rank_1": len(sim.plan.pairs) if r == 1 else None}


def _errors(group):
    n = dist.get_world_size(group)
    x = torch.zeros(T, H)
    w = torch.zeros(E, H)
    experts = make_experts(H, F, range(E // n) if E % n == 0 else range(1), device="cpu")
    idx = torch.zeros(T, 2, dtype=torch.long)
    cases = {
        "k > E": lambda: moe_layer(x, w, experts, E + 1, group=group),
        "k = 0": lambda: moe_layer(x, w, experts, 0, group=group),
        "capacity factor 0": lambda: moe_layer(x, w, experts, 1, 0.0, group=group),
        "capacity factor < 0": lambda: moe_layer(x, w, experts, 1, -1.0, group=group),
        "router hidden != tokens' hidden": lambda: moe_layer(x, torch.zeros(E, H + 1), experts, 1, group=group),
        "logits rows != tokens": lambda: ep_dispatch(x, torch.zeros(T + 1, 2, dtype=torch.long), E, group=group),
        "1-D logits": lambda: top_k_router(torch.zeros(E), 1),
        "wrong local expert count": lambda: moe_layer(x, w, make_experts(H, F, range(E // n + 1), device="cpu"), 1,
                                                      group=group),
        "expert id out of range": lambda: ep_dispatch(x, idx + E, E, group=group),
        "splits that do not add up to the rows": lambda: all_to_all_rows(x, [T + 1] + [0] * (n - 1), [T] * n,
                                                                           group=group),
        "splits for another group size": lambda: all_to_all_rows(x, [T, 0] * n, [T, 0] * n, group=group),
    }
    if n > 1:
        cases["E not divisible by e"] = lambda: moe_layer(x, torch.zeros(n + 1, H), experts, 1, group=group)
        cases["dispatch E % e"] = lambda: ep_dispatch(x, idx, n + 1, group=group)
    return {name: attempt(fn) for name, fn in cases.items()}


LAYER_CASES = [(k, cf, dtype) for k in (1, 2) for cf in (None, 0.5) for dtype in (torch.float64, torch.float32)]
STEP_CASES = [(1, None), (2, None), (4, None), (2, 0.5)]       # (ep, capacity factor) on 4 ranks


def _rank():
    groups = consecutive_groups([1, 2, 4], WORLD)
    out = {}
    for e, (group, _, _) in groups.items():
        for k, cf, dtype in LAYER_CASES:
            out[("layer", e, k, cf, dtype)] = _layer_case(group, k, cf, dtype, seed=k)
        out[("skew", e)] = _layer_case(group, 1, None, torch.float64, skew=True)
        for k, cf in ((1, None), (2, None), (2, 0.5)):
            out[("balanced", e, k, cf)] = _balanced_case(group, k, cf)
        out[("errors", e)] = _errors(group)
        out[("simulated", e)] = _simulated_case(group)
    for ep, cf in STEP_CASES:
        case = MoECase(capacity_factor=cf)
        ours = train_dp_ep(case, ep)
        ref = reference_train(case, WORLD)
        out[("step", ep, cf)] = {"param_err": max_param_error(ours["params"], ref["params"]),
                                 "loss_err": max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])),
                                 "traffic": ours["traffic"], "rows": ours["rows"], "names": sorted(ours["params"])}
    return out


@functools.lru_cache(maxsize=None)
def results():
    return minidist.launch(_rank, WORLD, timeout=180)


# ============================================================================= distributed tests
@pytest.mark.parametrize("e", [1, 2, 4])
@pytest.mark.parametrize("k,cf,dtype", LAYER_CASES)
def test_layer_equals_one_process(e, k, cf, dtype):
    for rank, res in enumerate(results()):
        got = res[("layer", e, k, cf, dtype)]
        for what in ("out", "dx", "drouter", "experts"):
            assert got[what] <= TOL[dtype], f"rank {rank}, e={e} k={k} cf={cf} {dtype}: {what} error {got[what]:.3g}"
    if cf is not None:
        assert results()[0][("layer", e, k, cf, dtype)]["dropped"] > 0, "capacity 0.5 must drop tokens"


@pytest.mark.parametrize("e", [1, 2, 4])
def test_traced_bytes_equal_formula(e):
    for rank, res in enumerate(results()):
        for k, cf, dtype in LAYER_CASES:
            got = res[("layer", e, k, cf, dtype)]
            elem = torch.finfo(dtype).bits // 8
            want = cost.ep_collectives(got["sent"], got["received"], H, E, e, elem_bytes=elem)
            assert got["traced"] == sorted(c.nbytes for c in want), (rank, e, k, cf, dtype)
            assert got["ops"] == (["all_to_all_single"] if e > 1 else [])


@pytest.mark.parametrize("e", [1, 2, 4])
def test_balanced_routing_matches_theory(e):
    for rank, res in enumerate(results()):
        for k, cf in ((1, None), (2, None), (2, 0.5)):
            got = res[("balanced", e, k, cf)]
            assert got["traced"] == got["theory"], (rank, e, k, cf)
            assert got["roundtrip"] <= 1e-15
            rows = cost.ep_rows(T, E, k, cf)
            assert sum(got["tokens_per_expert"]) == rows, (rank, e, k, cf)


@pytest.mark.parametrize("e", [1, 2, 4])
def test_experts_with_no_token(e):
    for rank, res in enumerate(results()):
        got = res[("skew", e)]
        assert got["empty"] == [1, 2, 3], got["empty"]
        assert max(got[w] for w in ("out", "dx", "drouter", "experts")) <= 1e-12
        assert got["zero_grads"], f"rank {rank}: an expert with no token has a non-zero gradient"
        assert got["received"] == (e * T if rank % e == 0 else 0)


@pytest.mark.parametrize("e", [1, 2, 4])
def test_the_group_simulated_in_one_process_equals_every_ranks_dispatch(e):
    for rank, res in enumerate(results()):
        got = res[("simulated", e)]
        assert all(got["same"].values()) and got["rows"] and got["splits"], (rank, e, got)
        assert got["received"] > 0 and got["sent_by_rank_1"] in (0, None), (rank, e, got)


@pytest.mark.parametrize("e", [1, 2, 4])
def test_bad_input_raises_before_any_collective(e):
    for rank, res in enumerate(results()):
        for name, (kind, message, sent) in res[("errors", e)].items():
            assert kind == "ValueError", f"rank {rank}, e={e}, {name}: {kind}: {message}"
            assert sent == 0, f"rank {rank}, e={e}, {name}: {sent} collectives before the error"


@pytest.mark.parametrize("ep,cf", STEP_CASES)
def test_dp_ep_step_equals_one_process(ep, cf):
    dp, c = WORLD // ep, MoECase()
    h, f, n_exp = c.hidden, c.ffn, c.num_experts
    expert_bytes = n_exp // ep * (2 * h * f + f + h) * 8          # this rank's experts, fp64
    for rank, res in enumerate(results()):
        got = res[("step", ep, cf)]
        assert got["param_err"] <= 1e-12 and got["loss_err"] <= 1e-12, (rank, got["param_err"], got["loss_err"])
        assert [n for n in got["names"] if n.startswith("moe.experts.")] == sorted(
            f"moe.experts.{j}.{p}" for j in range(rank % ep * n_exp // ep, (rank % ep + 1) * n_exp // ep)
            for p in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"))
        assert got["traffic"] == expected_traffic(MoECase(capacity_factor=cf), ep, WORLD, got["rows"]), rank
        reduces = sorted((size, nbytes) for op, size, nbytes in got["traffic"] if op == "all_reduce")
        dense = (h * h + h + n_exp * h) * 8
        assert reduces == sorted([(WORLD, dense)] + ([(dp, expert_bytes)] if dp > 1 else [])), (rank, reduces)


# ============================================================================= pure
def test_router_capacity_priority_and_weights():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 4, generator=g, dtype=torch.float64)
    for k in (1, 2, 3):
        for cf in (None, 0.3, 0.75, 2.0):
            r = top_k_router(logits, k, cf)
            probs = torch.softmax(logits, -1)
            assert torch.equal(r.indices, probs.argsort(-1, descending=True)[:, :k])
            assert torch.allclose(r.weights.sum(-1), torch.ones(10, dtype=torch.float64))
            cap = expert_capacity(10, 4, k, cf)
            assert cap == (None if cf is None else math.ceil(cf * 10 * k / 4))
            used = {j: 0 for j in range(4)}                  # GShard's order: choice-major, then token order
            for c in range(k):
                for t in range(10):
                    j = int(r.indices[t, c])
                    keep = cap is None or used[j] < cap
                    used[j] += keep
                    assert bool(r.mask[t, c]) == keep, (k, cf, t, c)


def test_losses():
    uniform = torch.full((8, 4), 0.25, dtype=torch.float64)
    idx = torch.arange(8).remainder(4).unsqueeze(1)
    assert load_balancing_loss(uniform, idx, 4).item() == pytest.approx(1.0)
    one_hot = torch.zeros(8, 4, dtype=torch.float64)
    one_hot[:, 0] = 1
    assert load_balancing_loss(one_hot, torch.zeros(8, 2, dtype=torch.long), 4).item() == pytest.approx(4.0)
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(logits, -1)
    loss = load_balancing_loss(probs, probs.topk(2).indices, 4)
    loss.backward()
    assert logits.grad.abs().sum() > 0, "the balancing loss must reach the router logits"
    assert router_z_loss(logits).item() == pytest.approx(torch.logsumexp(logits, -1).pow(2).mean().item())
    assert tokens_per_expert(idx, 4).tolist() == [2, 2, 2, 2]


def test_cost_formulas():
    c = cost.ep_bytes_per_rank(16, 8, 2, 8, 4, elem_bytes=2)
    assert c["dispatch_forward"] == c["combine_forward"] == 16 * 2 * 8 * 2 and c["counts"] == 64
    assert c["total"] == 4 * 16 * 2 * 8 * 2 + 64 and c["wire"] == c["total"] * 3 / 4
    assert cost.ep_bytes_per_rank(16, 8, 2, 8, 1)["total"] == 0
    assert cost.ep_rows(10, 4, 2, 0.5) == 4 * math.ceil(0.5 * 10 * 2 / 4) and cost.ep_rows(10, 4, 2, 4.0) == 20
    assert cost.rank_loads([3, 1, 0, 0], 2) == [4, 0] and cost.expert_load_imbalance([3, 1, 0, 0], 2) == 2.0
    assert cost.expert_load_imbalance([2, 2, 2, 2], 4) == 1.0
    assert cost.ep_comm_time(16, 8, 2, 8, 1, cost.NVLINK_H100) == 0.0
    assert cost.ep_comm_time(16, 8, 2, 8, 4, cost.INFINIBAND_NDR) > cost.ep_comm_time(16, 8, 2, 8, 4, cost.NVLINK_H100)
    for bad in (lambda: cost.ep_rows(4, 4, 5), lambda: cost.ep_collectives(1, 1, 8, 6, 4),
                lambda: cost.ep_rows(4, 4, 1, 0.0)):
        with pytest.raises(ValueError):
            bad()


def test_mesh_groups():
    assert ep_dp_groups(4, 2) == {"ep": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    assert ep_dp_groups(8, 4)["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError):
        ep_dp_groups(4, 3)


# ============================================================================= planner
def test_planner_ranks_ep_layouts_for_a_moe_model():
    from minidist.cost.planner import Cluster, ModelSpec, explain, plan_layouts, stage_param_split
    moe = ModelSpec(4.6e9, 2, 2048, 1, 1024, experts=64, top_k=2)      # one head: no TP, so EP must carry the experts
    h = 2048
    assert moe.layer_params == 4 * h * h + 8 * h + 64 * h + 64 * (8 * h * h + 5 * h)
    dense_part, experts = stage_param_split(moe, 1, 1, 4)
    assert experts == 2 * 16 * (8 * h * h + 5 * h) and dense_part + 4 * experts == pytest.approx(moe.params)
    cluster = Cluster(16, 8, 12e9)
    plans = plan_layouts(moe, cluster, global_batch=64)
    feasible = [p for p in plans if p.feasible]
    assert feasible and all(p.ep > 1 for p in feasible), "EP=1 cannot hold 64 experts' states in 12 GB"
    assert [p.time["total"] for p in feasible] == sorted(p.time["total"] for p in feasible)
    assert any("not divisible by EP" in p.reason for p in plans if moe.experts % p.ep) or all(
        moe.experts % p.ep == 0 for p in plans)
    assert all(p.time["ep"] > 0 and p.time["total"] == pytest.approx(
        sum(v for k, v in p.time.items() if k not in ("total", "hidden")) - p.time.get("hidden", 0.0))
               for p in feasible)      # overlap hides part of the communication (time["hidden"])
    by_layout = {(p.dp, p.pp, p.cp, p.ep, p.micro_batch): p for p in plans if p.time}
    across, inside = by_layout[(8, 2, 1, 8, 1)], by_layout[(8, 2, 1, 4, 1)]
    assert across.links["ep"] == "InfiniBand" and inside.links["ep"] == "NVLink"
    assert across.time["ep"] > inside.time["ep"]
    ep2 = by_layout[(8, 2, 1, 2, 1)]
    assert across.memory["params"] < inside.memory["params"] < ep2.memory["params"]     # weights split over EP
    assert across.memory["optimizer"] == inside.memory["optimizer"] == ep2.memory["optimizer"]   # ZeRO-1: / DP anyway
    text = explain(plans, cluster)
    top = feasible[0]
    assert f"EP={top.ep}" in text and "EP=1 (every GPU holds all experts): no layout that fits uses it." in text
    dense = plan_layouts(ModelSpec(4.6e9, 2, 2048, 1, 1024), cluster, global_batch=64)
    assert all(p.ep == 1 and "ep" not in p.time for p in dense)


def test_cli_plan_experts(capsys):
    from minidist.cli import main
    assert main(["plan", "--params", "53B", "--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "4096",
                 "--experts", "64", "--top-k", "2", "--gpus", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "64 experts per layer, top-2" in out and " EP " in out.splitlines()[out.splitlines().index(
        next(line for line in out.splitlines() if line.startswith("#")))]
    assert "EP inside a node" in out and "EP across nodes" in out
    assert main(["plan", "--model", "mixtral-8x7b", "--seq", "4096", "--gpus", "64", "--json"]) == 0
    import json
    data = json.loads(capsys.readouterr().out)
    assert any(p["ep"] > 1 and p["feasible"] for p in data["layouts"])
    with pytest.raises(SystemExit):
        main(["plan", "--model", "mixtral-8x7b", "--top-k", "9", "--gpus", "8"])
    assert "--top-k 9 is more than the 8 experts" in capsys.readouterr().err


def test_bench_rows_carry_traced_bytes_equal_to_the_formula():
    import argparse
    from minidist.benchmarks import expert_parallel as bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    rows = bench.run(parser.parse_args(["--tokens", "16", "--ep", "2", "--hidden", "8", "--experts", "4",
                                        "--steps", "1", "--warmup", "0"]))
    assert [(r["ep"], r["tokens"], r["equal"]) for r in rows] == [(2, 16, True)]
    assert rows[0]["bytes_theory"] == 4 * 16 * 2 * 8 * 4 + 8 * 4 and rows[0]["torch_a2a_ms"] > 0
    with pytest.raises(ValueError):
        bench.run(parser.parse_args(["--ep", "3", "--experts", "4"]))


# ============================================================================= GPU (make test-gpu; 4-GPU tour: e > 1)
def _one_rank_layer():
    from minidist.expert_parallel import MoELayer
    layer = MoELayer(H, F, E, k=2, capacity_factor=1.0, balance_coef=0.0, device=minidist.device())   # world of one
    x = torch.randn(3 * T, H, generator=torch.Generator().manual_seed(5)).to(minidist.device()).requires_grad_()
    y, aux = layer(x)
    (y.square().sum() + aux).backward()
    step = train_dp_ep(MoECase(), 1)
    return (str(y.device), x.detach().cpu(), y.detach().cpu(), x.grad.cpu(), layer.router.grad.cpu(),
            step["params"])


def check_one_rank_layer(device):
    where, x, y, dx, drouter, params = minidist.launch(_one_rank_layer, 1, device=device, timeout=120)[0]
    assert where.startswith(device)
    router = make_router_weight(H, E, 0, device="cpu").requires_grad_()
    xr = x.clone().requires_grad_()
    yr, _ = moe_reference(xr, router, make_experts(H, F, range(E), 0, device="cpu"), 2, 1.0)
    yr.square().sum().backward()
    for got, want in ((y, yr), (dx, xr.grad), (drouter, router.grad)):
        assert _err(got, want) <= 1e-5, _err(got, want)
    assert max_param_error(params, reference_train(MoECase(), 1, device="cpu")["params"]) <= 1e-12


@pytest.mark.gpu
@pytest.mark.skipif(visible_gpus() < 1, reason=f"needs 1 GPU, this machine has {visible_gpus()} visible")
def test_moe_layer_on_cuda_equals_the_cpu_reference():
    check_one_rank_layer("cuda")
