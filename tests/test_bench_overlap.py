"""`minidist bench overlap`: one real launch at small sizes (2 ranks, one timed step per version).
The rows are checked for what they must say, not for speed (timings on shared cores vary; the
measured ratios are in docs/VERIFICATION.md)."""
import json

import pytest

from minidist import cost
from minidist.cli import main

TECHNIQUES = ["all-gather + matmul", "matmul + reduce-scatter", "DDP buckets", "FSDP prefetch"]


def test_bench_overlap_rows(capsys):
    args = ["bench", "overlap", "--json", "--world-size", "2", "--seq", "64", "--d-in", "32", "--d-out", "32",
            "--hidden", "64", "--steps", "1", "--warmup", "0"]
    assert main(args) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [(r["technique"], r["version"]) for r in rows] == [(t, v) for t in TECHNIQUES
                                                             for v in ("plain", "overlapped")]
    for plain, ours in zip(rows[::2], rows[1::2]):
        for r in (plain, ours):
            assert 0 <= r["exposed_ms"] <= r["step_ms"] and r["world_size"] == 2
            assert r["exposed_ms"] <= r["in_flight_ms"] + 1e-9      # waits lie inside the ops waited on
        assert ours["exposed_ratio"] == pytest.approx(ours["exposed_ms"] / plain["exposed_ms"])
    fsdp = rows[-1]
    units = [(64 * 64 + 64) * 4] * 4                       # four Linear(64, 64) units, fp32, even over 2 ranks
    assert fsdp["prefetch_extra_formula"] == cost.prefetch_extra_bytes(units) == units[0]
    assert fsdp["prefetch_extra_bytes"] == fsdp["forward_peak_bytes"] - rows[-2]["forward_peak_bytes"]
    assert "all-gather + matmul on 2 ranks: exposed" in captured.err


def test_bench_overlap_refuses_a_sequence_that_does_not_split():
    with pytest.raises(SystemExit):
        main(["bench", "overlap", "--world-size", "3", "--seq", "64"])
