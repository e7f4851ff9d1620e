"""The layout planner (minidist.cost.planner) and `minidist plan`: pure arithmetic, no ranks."""
import json

import pytest

from minidist.cli import main
from minidist.cost.planner import Cluster, ModelSpec, axis_links, plan_layouts

SEVEN_B = ModelSpec(params=7e9, layers=32, hidden=4096, heads=32, seq=4096)


def test_the_32_gpu_example_dp2_tp4_pp4_is_listed_and_fits():
    plans = plan_layouts(SEVEN_B, Cluster(32, 8, 80e9))
    ours = [p for p in plans if (p.dp, p.pp, p.tp, p.cp) == (2, 4, 4, 1)]
    assert ours and all(p.feasible for p in ours)
    assert ours[0].links == {"tp": "NVLink", "cp": "NVLink", "pp": "InfiniBand", "dp": "InfiniBand"}


def test_ranking_is_deterministic_and_sorted():
    a = [p.as_dict() for p in plan_layouts(SEVEN_B, Cluster(64, 8, 80e9))]
    b = [p.as_dict() for p in plan_layouts(SEVEN_B, Cluster(64, 8, 80e9))]
    assert a == b
    feasible = [p["time"]["total"] for p in a if p["feasible"]]
    assert feasible == sorted(feasible) and all(not p["feasible"] for p in a[len(feasible):])
    assert all(p["dp"] * p["pp"] * p["tp"] * p["cp"] == 64 for p in a)


def test_excluded_layouts_carry_their_reason():
    plans = plan_layouts(SEVEN_B, Cluster(64, 8, 80e9))
    reasons = {(p.dp, p.pp, p.tp, p.cp, p.micro_batch): p.reason for p in plans if not p.feasible}
    assert "TP stays on NVLink" in reasons[(1, 4, 16, 1, 1)]            # TP 16 over two 8-GPU nodes
    assert "not divisible by PP=64" in reasons[(1, 64, 1, 1, 1)]        # 32 layers
    assert any("GB per GPU" in r for r in reasons.values())             # memory
    heads = plan_layouts(ModelSpec(7e9, 32, 4096, 12, 4096), Cluster(8, 8, 80e9))
    assert any("heads (12) not divisible by TP=8" in p.reason for p in heads)
    assert all(p.memory["total"] <= 80e9 for p in plans if p.feasible)


def test_links_follow_the_mesh_order():
    assert axis_links(dp=2, pp=4, cp=1, tp=4, gpus_per_node=8) == {"tp": False, "cp": False, "pp": True, "dp": True}
    assert axis_links(dp=4, pp=1, cp=1, tp=8, gpus_per_node=8)["dp"]


def test_top_layout_of_a_small_case_is_the_hand_computed_one():
    # Two nodes of one GPU: TP would cross nodes (excluded). By hand, with h = s = 1024, L = 4,
    # B = 64, V = (1e8 - 4(12h² + 13h)) / 2h, peak 989e12 at mfu 0.5 on 2 GPUs:
    model, cluster = ModelSpec(1e8, 4, 1024, 16, 1024), Cluster(2, 1, 80e9)
    h, s, B = 1024, 1024, 64
    vocab = (1e8 - 4 * (12 * h * h + 13 * h)) / (2 * h)
    compute = (4 * 72 * B * s * h * h * (1 + s / (6 * h)) + 6 * B * s * h * vocab) / (2 * 989e12 * 0.5)
    dp2 = compute + 2 * 5e-6 + 2 * 1e8 / 50e9        # ring all-reduce of 2 bytes/param, n = 2: 2α + Sβ
    pp2 = compute + compute / 64 + 2 * 64 * (5e-6 + 2 * s * h / 50e9)   # bubble (p-1)/m, m = 64; act + grad
    assert dp2 < pp2
    top = plan_layouts(model, cluster, global_batch=B)[0]
    assert (top.dp, top.pp, top.tp, top.cp, top.micro_batch) == (2, 1, 1, 1, 1)
    assert top.time["total"] == pytest.approx(dp2, rel=1e-12)
    pp = next(p for p in plan_layouts(model, cluster, global_batch=B) if (p.pp, p.micro_batch) == (2, 1))
    assert pp.time["total"] == pytest.approx(pp2, rel=1e-12)


def test_cli_plan_table_and_json(capsys):
    args = ["plan", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "4096",
            "--gpus", "32", "--gpus-per-node", "8", "--gpu-memory", "80GB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "layouts fit on 32 GPUs" in out and "Top: DP" in out and "bubble" in out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    example = [p for p in data["layouts"] if (p["dp"], p["pp"], p["tp"], p["cp"]) == (2, 4, 4, 1)]
    assert example and example[0]["feasible"]
    assert all(p["reason"] for p in data["layouts"] if not p["feasible"])


def test_bad_model_raises():
    with pytest.raises(ValueError, match="more than params"):
        plan_layouts(ModelSpec(1e6, 32, 4096, 32, 4096), Cluster(8, 8, 80e9))
