"""Checkpoint costs (minidist.cost.checkpoint) and `minidist plan --mtbf --storage-bw`."""
import math

import pytest

from minidist.cli import main
from minidist.cost import checkpoint as cc


def test_young_interval_is_where_the_first_order_waste_is_smallest():
    cost, mtbf = 30.0, 3 * 3600.0
    waste = lambda tau: 1 - cc.goodput(tau, cost, mtbf)      # noqa: E731
    grid = [10.0 * i for i in range(1, 2000)]
    best = min(grid, key=waste)
    assert abs(best - cc.young_interval(cost, mtbf)) <= 10.0
    assert cc.young_interval(cost, mtbf) == pytest.approx(math.sqrt(2 * cost * mtbf))
    # Daly 2006 refines Young by terms in sqrt(C/2M): close when C << M, never above M
    assert cc.daly_interval(cost, mtbf) == pytest.approx(cc.young_interval(cost, mtbf) - cost, rel=0.05)
    assert cc.daly_interval(10 * mtbf, mtbf) == mtbf


def test_an_async_save_blocks_less_so_the_goodput_is_higher():
    blocking = cc.goodput(600, 60, 3600)
    async_ = cc.goodput(600, 60, 3600, blocking_s=1)
    assert async_ - blocking == pytest.approx(59 / 600)
    assert cc.goodput(10, 100, 50) == 0.0        # saving more than working: nothing is kept


def test_bytes_per_rank_replicated_dp_rank0_writes_sharded_everyone_writes_a_slice():
    psi = 1003
    rep = cc.checkpoint_bytes_per_rank(psi, dp=4, zero=0)
    assert rep == [12 * psi, 0, 0, 0]
    z = cc.checkpoint_bytes_per_rank(psi, dp=4, zero=3)
    assert sum(z) == 12 * psi and z[0] == 12 * math.ceil(psi / 4) and z[-1] == 12 * (psi - 3 * math.ceil(psi / 4))
    tp_pp = cc.checkpoint_bytes_per_rank(1200, dp=2, tp=2, pp=3)
    assert tp_pp == [12 * 200] * 6 + [0] * 6          # each (pp, tp) position owns 1/6, DP rank 0 writes it
    assert [cc.flat_shard_elements(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [cc.flat_shard_elements(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="zero"):
        cc.checkpoint_bytes_per_rank(10, zero=4)


def test_save_time_is_all_bytes_over_storage_and_the_busiest_rank_over_its_link():
    assert cc.save_seconds([100, 100], 50.0) == 4.0
    assert cc.save_seconds([200, 0], 100.0, rank_bw=50.0) == 4.0      # one writer: its link decides
    assert cc.save_seconds([100, 100], 100.0, rank_bw=50.0) == 2.0


def test_plan_reports_checkpoint_size_save_time_interval_and_goodput(capsys):
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--mtbf", "3", "--storage-bw", "10", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "ckpt/rank (GB)" in out and "goodput (%)" in out and "Young 1974" in out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-7b", "--gpus", "8", "--mtbf", "3"])
    assert "give both --mtbf and --storage-bw" in capsys.readouterr().err
