"""Pipeline schedules, validator, simulator, partitioning, cost formulas: no processes."""
import itertools

import pytest
import torch.nn as nn

from minidist.cost import pipeline_bubble, pipeline_peak_activations
from minidist.pipeline import (Action, Costs, Schedule, ScheduleError, check, make, simulate, validate,
                               balanced_boundaries, partition, rank_chunks, to_chrome)

PS, MS = (2, 3, 4), (1, 2, 3, 4, 8, 16)
COSTS = [Costs(1, 2), Costs(1, 1), Costs(2, 3), Costs(1, 2, BI=1.2, BW=0.8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_theory_exactly(name):
    for p, m, c in itertools.product(PS, MS, COSTS):
        r = simulate(make(name, p, m), c)
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m, c)
        assert r.makespan == pytest.approx((m + p - 1) * (c.F + c.B), abs=1e-9)


def test_naive_is_gpipe_with_one_microbatch():
    for p in PS:
        assert simulate(make("naive", p, 1)).bubble == pytest.approx((p - 1) / p, abs=1e-12)


def test_interleaved_bubble_is_theory_exactly():
    for p, v, mult in itertools.product(PS, (2, 3), (1, 2, 4)):
        m = p * mult
        for c in COSTS[:3]:
            r = simulate(make("interleaved", p, m, v=v), c)
            assert r.bubble == pytest.approx(pipeline_bubble("interleaved", p, m, v), abs=1e-12), (p, m, v, c)


def test_zb_h1_bubble_is_theory_and_a_third_of_1f1b_at_the_same_peak_memory():
    for p, m, c in itertools.product(PS, MS, COSTS):
        if m < p:
            continue
        zb, ob = simulate(make("zb-h1", p, m), c), simulate(make("1f1b", p, m), c)
        assert zb.bubble == pytest.approx(pipeline_bubble("zb-h1", p, m, t_f=c.F, t_b=c.B, t_bw=c.of("BW")),
                                          abs=1e-12), (p, m, c)
        assert max(zb.peak_activations) == max(ob.peak_activations) == p
        if c == Costs(1, 2):    # t_F = t_BI = t_BW: bubble time (p-1) vs 3(p-1)
            assert zb.makespan - 3 * m == pytest.approx((ob.makespan - 3 * m) / 3)


def test_simulated_peak_activations_match_theory():
    for name, p, m in itertools.product(["gpipe", "1f1b", "zb-h1"], PS, MS):
        r = simulate(make(name, p, m))
        assert r.peak_activations == [pipeline_peak_activations(name, p, m, k) for k in range(p)], (name, p, m)
    for p, v in itertools.product(PS, (2, 3)):
        for m in (p, 4 * p):
            r = simulate(make("interleaved", p, m, v=v))
            assert r.peak_activations == [pipeline_peak_activations("interleaved", p, m, k, v) for k in range(p)]
    one = simulate(make("1f1b", 4, 16)).peak_activations
    assert max(one) == 4 and simulate(make("gpipe", 4, 16)).peak_activations == [16] * 4


def test_every_generated_schedule_is_valid():
    for p, m in itertools.product(PS, MS):
        for name, kw in [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("interleaved", {"v": 2})]:
            if name == "interleaved" and m % p:
                continue
            assert validate(make(name, p, m, **kw)) == [], (name, p, m)


def test_warmup_of_1f1b_is_min_p_minus_rank_minus_1_and_m():
    for p, m in itertools.product(PS, MS):
        s = make("1f1b", p, m)
        for r in range(p):
            kinds = [a.kind for a in s.compute(r)]
            assert kinds.index("B") == min(p - r - 1, m) + (1 if m > p - r - 1 else 0)


@pytest.mark.parametrize("call, msg", [
    (lambda: make("interleaved", 4, 6, v=2), "multiple of p"),
    (lambda: make("interleaved", 2, 3, v=2), "multiple of p"),
    (lambda: make("interleaved", 4, 8, v=1), "v >= 2"),
    (lambda: make("naive", 2, 8), "m=1"),
    (lambda: make("gpipe", 4, 0), "positive"),
    (lambda: make("1f1b", 0, 4), "positive"),
    (lambda: make("pipedream", 4, 4), "unknown schedule"),
])
def test_bad_parameters_raise_value_error(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def _edit(s: Schedule, rank: int, fn) -> Schedule:
    acts = [list(a) for a in s.actions]
    acts[rank] = fn(acts[rank])
    return Schedule(s.name + "-broken", s.p, s.m, s.v, acts)


def test_validator_rejects_a_deadlocking_order():
    # Rank 0 waits for the gradient before it sends the activation that produces it.
    s = make("gpipe", 2, 1)      # rank 0: F0 SEND_F0 RECV_B0 B0
    bad = _edit(s, 0, lambda a: [a[2], a[0], a[1], a[3]])
    problems = validate(bad)
    assert len(problems) == 1 and "deadlock" in problems[0] and "rank 0" in problems[0]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad)          # reported, not looped on
    with pytest.raises(ValueError):
        check(bad)


def test_validator_rejects_a_missing_send():
    s = make("1f1b", 3, 4)
    bad = _edit(s, 1, lambda a: [x for x in a if not (x.kind == "SEND_F" and x.mb == 2)])
    text = "\n".join(validate(bad))
    assert "never sent" in text and "never sends" in text


def test_validator_rejects_backward_before_forward():
    s = make("gpipe", 2, 2)
    bad = _edit(s, 1, lambda a: [x if x.kind not in ("F", "B") or x.mb != 0
                                 else Action("B" if x.kind == "F" else "F", 0) for x in a])
    assert any("backward before forward" in t for t in validate(bad))


def test_validator_rejects_holding_a_microbatch_twice_and_out_of_order_messages():
    s = make("gpipe", 2, 2)
    twice = _edit(s, 0, lambda a: a[:2] + [Action("F", 0)] + a[2:])
    assert any("already holds micro-batch 0" in t for t in validate(twice))
    # rank 1 receives micro-batch 1 first: messages match in order, so this is a mismatch
    swapped = _edit(s, 1, lambda a: [Action("RECV_F", 1 - x.mb, 0, 0) if x.kind == "RECV_F" else x for x in a])
    assert any("match in order" in t for t in validate(swapped))


def test_zb_split_must_run_bi_before_bw():
    s = make("zb-h1", 2, 2)
    bad = _edit(s, 1, lambda a: [Action("BW" if x.kind == "BI" else "BI", x.mb) if x.kind in ("BI", "BW") else x
                                 for x in a])
    assert any("before input gradient" in t for t in validate(bad))


def test_balanced_partition_minimises_the_largest_stage():
    sizes = [5, 1, 1, 7, 2, 2, 9, 1, 3]
    for k in range(1, 6):
        cuts = balanced_boundaries(sizes, k)
        got = max(sum(sizes[a:b]) for a, b in zip([0] + cuts, cuts + [len(sizes)]))
        best = min(max(sum(sizes[a:b]) for a, b in zip((0,) + c, c + (len(sizes),)))
                   for c in itertools.combinations(range(1, len(sizes)), k - 1))
        assert got == best


def test_partition_by_boundaries_and_errors():
    layers = [nn.Linear(4, 4) for _ in range(5)]
    stages = partition(layers, 3, boundaries=[2, 3])
    assert [len(s) for s in stages] == [2, 1, 2] and stages[1][0] is layers[2]
    assert [len(s) for s in partition(layers, 5)] == [1] * 5
    with pytest.raises(ValueError, match="at least one layer"):
        partition(layers, 3, boundaries=[2, 2])
    with pytest.raises(ValueError, match="cannot cut"):
        partition(layers, 6)
    assert rank_chunks(list("abcdef"), 3, 1) == ["b", "e"]


def test_bubble_formulas():
    assert pipeline_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble("interleaved", 4, 8, v=2) == pytest.approx(3 / 19)
    assert pipeline_bubble("naive", 4, 8) == pytest.approx(3 / 4)
    assert pipeline_bubble("zb-h1", 4, 8) == pytest.approx(3 / 27)
    with pytest.raises(ValueError):
        pipeline_bubble("zb-h1", 4, 2)


def test_chrome_export_of_a_simulated_timeline():
    r = simulate(make("1f1b", 2, 2))
    doc = to_chrome(r.timeline)
    assert len(doc["traceEvents"]) == 2 * 2 * 2
    assert {e["tid"] for e in doc["traceEvents"]} == {0, 1}


def test_validator_catches_a_deadlock_that_only_nccl_would_hit():
    # Interleaved 1F1B on p=2 with each compute action's messages in their own group:
    # ranks 0 and 1 each block on a send to the other on their shared pair stream.
    # Gloo would buffer its way through; NCCL would hang. Fusing F and B into one step
    # (as interleaved_1f1b does) puts both directions in one group and fixes it.
    from minidist.pipeline import with_comms

    good = make("interleaved", 2, 4, v=2)
    unfused = with_comms("unfused", 2, 4, 2, [good.compute(r) for r in range(2)])
    assert [a for r in range(2) for a in unfused.compute(r)] == [a for r in range(2) for a in good.compute(r)]
    problems = validate(unfused)
    assert len(problems) == 1 and "deadlocks" in problems[0]
    assert validate(good) == []
