"""The layout planner (minidist.cost.planner), its model presets and `minidist plan`: pure
arithmetic, no ranks."""
import json

import pytest

from minidist.cli import main
from minidist.cost.planner import Cluster, ModelSpec, axis_links, headroom_warning, plan_layouts
from minidist.presets import PRESETS

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
    # selective recomputation (the default) runs QKᵀ and the weighted V again: 4Bs²h per layer
    layer = 72 * B * s * h * h * (1 + s / (6 * h)) + 4 * B * s * s * h
    compute = (4 * layer + 6 * B * s * h * vocab) / (2 * 989e12 * 0.5)
    dp2 = compute + 2 * 5e-6 + 2 * 1e8 / 50e9        # ring all-reduce of 2 bytes/param, n = 2: 2α + Sβ
    pp2 = compute + compute / 64 + 2 * 64 * (5e-6 + 2 * s * h / 50e9)   # bubble (p-1)/m, m = 64; act + grad
    assert dp2 < pp2
    top = plan_layouts(model, cluster, global_batch=B, overlap=())[0]      # nothing hidden
    assert (top.dp, top.pp, top.tp, top.cp, top.micro_batch) == (2, 1, 1, 1, 1)
    assert top.time["total"] == pytest.approx(dp2, rel=1e-12)
    pp = next(p for p in plan_layouts(model, cluster, global_batch=B, overlap=()) if (p.pp, p.micro_batch) == (2, 1))
    assert pp.time["total"] == pytest.approx(pp2, rel=1e-12)
    # DDP's overlap (the default): the all-reduce hides behind the last micro-batch's backward, 2/3 of
    # its compute; with micro-batches of 8 (m = 4) that is 2/3 · compute / 4, the largest share, so it wins.
    comm = 2 * 5e-6 + 2 * 1e8 / 50e9
    dp2_overlap = compute + max(0.0, comm - 2 / 3 * compute / 4)
    top = plan_layouts(model, cluster, global_batch=B)[0]
    assert (top.dp, top.pp, top.tp, top.cp, top.micro_batch) == (2, 1, 1, 1, 8)
    assert top.time["total"] == pytest.approx(dp2_overlap, rel=1e-12)
    assert top.time["hidden"] == pytest.approx(comm - max(0.0, comm - 2 / 3 * compute / 4), rel=1e-12)


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


def test_layouts_with_headroom_rank_first_each_group_by_time():
    plans = [p for p in plan_layouts(SEVEN_B, Cluster(32, 8, 80e9), headroom=0.5) if p.feasible]
    roomy = [p.free >= 0.5 for p in plans]
    assert any(roomy) and not all(roomy) and roomy == sorted(roomy, reverse=True)
    for group in (plans[:sum(roomy)], plans[sum(roomy):]):
        assert [p.time["total"] for p in group] == sorted(p.time["total"] for p in group)
    assert all(p.free == pytest.approx(1 - p.memory["total"] / 80e9) for p in plans)
    assert headroom_warning(plans, Cluster(32, 8, 80e9), 0.5) == ""
    cramped = plan_layouts(SEVEN_B, Cluster(32, 8, 80e9), headroom=0.99)       # no layout leaves 99% free
    assert "no layout leaves 99% of GPU memory free" in headroom_warning(cramped, Cluster(32, 8, 80e9), 0.99)


def test_a_preset_is_its_paper_s_numbers_and_flags_override_it(capsys):
    assert (PRESETS["llama-70b"].layers, PRESETS["llama-70b"].hidden, PRESETS["llama-70b"].heads) == (80, 8192, 64)
    assert PRESETS["gpt3-175b"] == PRESETS["gpt3-175b"].__class__(175e9, 96, 12288, 96, 2048,
                                                                  PRESETS["gpt3-175b"].source)
    assert main(["plan", "--model", "llama-7b", "--seq", "8192", "--gpus", "32", "--headroom", "15%"]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())            # as read, whatever the wrapping
    for assumption in ("llama-7b preset; --seq given", "6.74B parameters, 32 layers, hidden 4096, 32 heads",
                       "sequence 8192 tokens", "global batch 512", "ZeRO-1", "recomputation selective",
                       "989 TFLOP/s per GPU at 50% MFU", "450 GB/s", "50 GB/s", "80.0 GB each",
                       "at least 15% of GPU memory free"):
        assert assumption in text, assumption
    assert text.index("Headroom:") < text.index("layouts fit on 32 GPUs") < text.index("Top: DP")
    header = next(line for line in out.splitlines() if line.startswith("#  "))
    assert "memory (GB)" in header and ("step (s)" in header or "step (ms)" in header) and "free (%)" in header
    assert main(["plan", "--model", "llama-7b", "--gpus", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layouts"][0]["feasible"] and any("MFU" in line for line in data["assumptions"])


def test_explanation_wraps_at_the_terminal_width(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["plan", "--model", "llama-70b", "--gpus", "64"]) == 0
    prose = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("#", "-", " ", "("))
             and not line[:1].isdigit()]
    assert prose and max(len(line) for line in prose) <= 60


def test_overlap_only_hides_communication_and_the_cli_names_it(capsys):
    """Each layout's step time: compute + bubble + communication - hidden; counting more overlap never
    makes a layout slower, and hides at most its DP and TP traffic."""
    by = {o: {p.layout + f" b{p.micro_batch}": p.time for p in plan_layouts(SEVEN_B, Cluster(32, 8, 80e9), overlap=o)
              if p.feasible} for o in [(), ("dp",), ("dp", "tp")]}
    assert by[()].keys() == by[("dp",)].keys() == by[("dp", "tp")].keys()
    for layout, none in by[()].items():
        dp, both = by[("dp",)][layout], by[("dp", "tp")][layout]
        assert none["hidden"] == 0 and 0 <= dp["hidden"] <= none["dp"] and dp["hidden"] <= both["hidden"]
        assert both["hidden"] <= none["dp"] + none["tp"]
        parts = sum(both[k] for k in ("compute", "bubble", "tp", "cp", "pp", "dp"))
        assert both["total"] == pytest.approx(parts - both["hidden"], rel=1e-12)
    assert any(by[("dp", "tp")][k]["hidden"] > by[("dp",)][k]["hidden"] for k in by[()])    # TP hides something
    with pytest.raises(ValueError, match="the planner knows"):
        plan_layouts(SEVEN_B, Cluster(32, 8, 80e9), overlap=("pp",))
    args = ["plan", "--model", "llama-7b", "--gpus", "16"]
    assert main(args + ["--overlap", "none"]) == 0
    assert "no overlap of communication with compute" in " ".join(capsys.readouterr().out.split())
    assert main(args + ["--overlap", "dp,tp"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "asynchronous TP hides" in out and "hidden (s)" in out
