"""`minidist bench plan`: Spearman's rho, the planner fed with fitted constants, and how one launch's
per-rank measurements become rows. No ranks start here: the launch is replaced by synthetic per-rank
results whose answer is known (the real run is `minidist bench plan`, seconds long)."""
import json

import pytest

import minidist.runtime

from minidist.benchmarks import plan as bench
from minidist.cli import main
from minidist.cost.tensor_parallel import tp_layer_flops
from minidist.models import GPTConfig

CFG = GPTConfig(vocab=16, d_model=8, n_heads=4, n_layers=2, seq_len=4)


def test_spearman_and_ranks():
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swap among 4: 1 - 6·Σd²/(n(n²-1)) = 1 - 6·2/60
    assert bench.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert bench.ranks([5.0, 1.0, 5.0, 3.0]) == [3.5, 1.0, 3.5, 2.0]       # ties share the mean rank
    with pytest.raises(ValueError):
        bench.spearman([1, 1, 1], [1, 2, 3])


def test_parse_layouts():
    assert bench.parse_layouts("2x2x2, 1x2X4") == [(2, 2, 2), (1, 2, 4)]
    for bad in ("2x2", "0x2x4", "axbxc"):
        with pytest.raises(ValueError):
            bench.parse_layouts(bad)


def test_model_time_is_the_planners_with_the_fitted_constants():
    kw = dict(batch=8, micro_batches=2, flops=1e9)
    free = bench.model_time(CFG, (2, 2, 2), alpha=0.0, beta=0.0, **kw)     # free links: compute and bubble only
    h, s = CFG.d_model, CFG.seq_len
    compute = (CFG.n_layers * tp_layer_flops(8, s, h) + 6 * 8 * s * h * CFG.vocab) / (8 * 1e9)
    assert free["compute"] == pytest.approx(compute)
    assert free["bubble"] == pytest.approx(compute * (2 - 1) / 2)
    assert free["tp"] == free["pp"] == free["dp"] == 0
    slow = {x: bench.model_time(CFG, x, alpha=1e-3, beta=0.0, **kw) for x in [(8, 1, 1), (2, 2, 2), (1, 1, 8)]}
    # DP: one ring all-reduce per step (2·7 α); TP: 4 all-reduces per layer and micro-batch (m = 2), 2·7 α each
    assert slow[(8, 1, 1)]["dp"] == pytest.approx(14e-3)
    assert slow[(1, 1, 8)]["tp"] == pytest.approx(CFG.n_layers * 2 * 4 * 14e-3)
    assert slow[(8, 1, 1)]["total"] < slow[(2, 2, 2)]["total"] < slow[(1, 1, 8)]["total"]


def test_bad_layouts_are_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(minidist.runtime, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="not divisible"):
        bench.measure(CFG, [(1, 1, 8), (8, 1, 1)], batch=8, micro_batches=1)     # 4 heads, tp=8
    with pytest.raises(ValueError):
        bench.measure(CFG, [(2, 2, 2), (4, 1, 1)], batch=8, micro_batches=1)     # two world sizes


def fake_launch(step_ms):
    """Per-rank results of a run whose p2p times follow α = 50 µs, β = 1 ns/B and whose steps took step_ms."""
    def run(fn, world, cfg, layouts, batch, m, schedule, steps, warmup, timeout):
        return [{"p2p": {s: [50e-6 + s * 1e-9 + r * 1e-7] * 3 for s in bench.P2P_SIZES}, "flops": 1e9 + r,
                 "step_s": [[t * 1e-3 * (1 + 0.01 * r)] * steps for t in step_ms]} for r in range(world)]
    return run


def test_rows_from_one_launch(monkeypatch):
    layouts = [(8, 1, 1), (2, 2, 2), (1, 2, 4), (4, 1, 2)]
    monkeypatch.setattr(minidist.runtime, "launch", fake_launch([10, 20, 40, 30]))
    rows = bench.measure(CFG, layouts, batch=8, micro_batches=1, steps=3)
    assert [r["layout"] for r in rows] == ["8x1x1", "2x2x2", "4x1x2", "1x2x4"]     # fastest measured first
    assert rows[0]["measured_ms"] == pytest.approx(10 * 1.07)                     # the slowest rank's step
    assert rows[0]["alpha_us"] == pytest.approx(50.7, rel=0.01)                  # rank 7's p2p times
    assert rows[0]["beta_GBps"] == pytest.approx(1.0, rel=0.01)
    model = {r["layout"]: r["model_ms"] for r in rows}
    expected = bench.spearman([model[f"{d}x{p}x{t}"] for d, p, t in layouts], [10, 20, 40, 30])
    assert all(r["spearman_rho"] == pytest.approx(expected) for r in rows)
    assert sorted(r["model_rank"] for r in rows) == [1, 2, 3, 4]


def test_cli_json_shape(monkeypatch, capsys):
    monkeypatch.setattr(minidist.runtime, "launch", fake_launch([10, 20, 40, 30, 25, 15]))
    args = ["bench", "plan", "--json", "--layouts", "8x1x1,2x2x2,4x1x2,4x2x1,2x4x1,1x4x2", "--d-model", "8",
            "--heads", "2", "--layers", "4", "--seq", "4", "--vocab", "16", "--batch", "16", "--steps", "2"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6
    assert {"layout", "measured_ms", "model_ms", "measured_rank", "model_rank", "alpha_us", "beta_GBps",
            "gflops_per_rank", "spearman_rho"} <= set(rows[0])
    assert -1 <= rows[0]["spearman_rho"] <= 1
