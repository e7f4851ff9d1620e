"""Lab 11's checks refuse minidist's own overlap and timeline, and judge the schedule from the recorded
times: these tests give the verdicts answers written by hand (a right schedule, and each way of getting it
wrong that the bank's bugs stand for) and call the checks with the library's code pasted in. (The bug bank
and the correct alternatives are in solutions/lab11_overlap/bugbank.py, run by the selftest.)"""
import pytest

from minidist.checks import lab11_overlap as lab11
from minidist.checks.kit.run import RankCase
from minidist.checks.lab11_overlap import cases, verdicts

REFUSED = "called minidist's own implementation"


def library_ring(x_shard, weight, mm, group=None):
    """The library's ring, adapted to the notebook's signature: what a student might paste or call."""
    import torch.distributed as dist

    from minidist.overlap import ring_all_gather_consume
    n, t = x_shard.shape[0], dist.get_world_size(group)
    out = x_shard.new_empty((t * n, weight.shape[0]))

    def consume(c, x_c):
        out[c * n:(c + 1) * n] = mm(x_c, weight)
    ring_all_gather_consume(x_shard, consume, group)
    return out


def library_exposed(events, rank):
    from minidist.trace.events import Event, Trace
    from minidist.trace.timeline import exposed
    return exposed(Trace(Event(**e) for e in events), rank)


def test_the_library_is_refused():
    with pytest.raises(AssertionError, match=REFUSED):
        lab11.check_all_gather_matmul(library_ring)
    with pytest.raises(AssertionError, match=REFUSED):
        lab11.check_exposed_time(library_exposed)


def test_the_visible_timelines_need_the_union_of_the_waits():
    """What the visible cases ask for, worked out by hand: a blocking call; an isend's issuing and its tail after
    wait() (another rank's irecv left out); waits inside others, counted once (regions left out)."""
    want = [0.5, 0.5, 0.25 + 2.0]
    for case, w in zip(cases.function_cases("exposed_time", hidden=False), want):
        assert verdicts.exposed_verdict(case, w) is None
        assert "returned" in verdicts.exposed_verdict(case, w + 0.1)
    assert "expected a number" in verdicts.exposed_verdict(cases.VISIBLE_TIMELINES[0], True)


# ----------------------------------------------------------------------------- the ring's schedule, by hand
CASE = cases.VISIBLE["all_gather_matmul"][0]            # t = 2
SHARD = CASE["n"] * CASE["k"] * 4


def ring_answer(**change) -> dict:
    """Rank 0 of a group of 2 (world ranks 0, 1): the right output, and a right schedule unless ``change``
    says otherwise: send and receive posted at 0.1, the own chunk's matmul 0.2-0.5, the waits at 0.6."""
    send = ["isend", 1, SHARD, 0.1, 0.11, 0.6, 0.62]
    recv = ["irecv", 1, SHARD, 0.1, 0.11, 0.6, 0.63]
    answer = {"out": cases.ag_reference(CASE, 2), "comm": [send, recv], "computed": [[0, 0.2, 0.5], [1, 0.7, 0.9]]}
    for key, value in change.items():
        kind, field = key.split("_", 1)
        event = send if kind == "send" else recv
        event[{"start": 3, "issued": 4, "waited": 5, "peer": 1, "bytes": 2, "op": 0}[field]] = value
    return answer


@pytest.mark.parametrize("change, words", [
    ({}, None),
    ({"send_waited": 0.15}, "step 0's send was waited for before"),
    ({"recv_waited": 0.15}, "step 0's receive was waited for before"),
    ({"send_start": 0.55}, "posted after"),
    ({"send_issued": None}, "blocking call"),
    ({"send_waited": None}, "never waited for"),
    ({"send_bytes": 2 * SHARD}, "each ring step moves one shard"),
    ({"send_op": "send"}, "blocking send/recv"),
    ({"recv_op": "all_gather_into_tensor"}, "not a collective"),
])
def test_the_ring_verdict_reads_the_schedule(change, words):
    problem = verdicts.ag_matmul(RankCase(CASE, 0, 0, 2, "all_gather_matmul"), ring_answer(**change))
    assert (problem is None) if words is None else (words in (problem or ""))


def test_the_ring_verdict_wants_each_chunk_once():
    answer = ring_answer()
    answer["computed"] = [[0, 0.2, 0.5], [0, 0.7, 0.9]]
    assert "once per chunk" in verdicts.ag_matmul(RankCase(CASE, 0, 0, 2, "all_gather_matmul"), answer)


def test_prefetch_one_unit_ahead_and_no_more():
    """Three units: every gather posted at the start overlaps, but holds three full weights at once."""
    case = cases.VISIBLE["prefetch_forward"][0]
    shard = case["d"] // 2 * case["d"] * 4
    computed = [[0, 0.2, 0.3], [1, 0.4, 0.5], [2, 0.6, 0.7]]
    ahead = [["all_gather_into_tensor", None, shard, s, s + 0.01, w, w + 0.01] for s, w in
             ((0.0, 0.1), (0.15, 0.35), (0.35, 0.55))]
    upfront = [["all_gather_into_tensor", None, shard, s, s + 0.01, w, w + 0.01] for s, w in
               ((0.0, 0.1), (0.02, 0.35), (0.04, 0.55))]
    item = RankCase(case, 0, 0, 2, "prefetch_forward")
    out = cases.prefetch_reference(case)
    assert verdicts.prefetch(item, {"out": out, "comm": ahead, "computed": computed}) is None
    assert "three units' full weights" in verdicts.prefetch(item, {"out": out, "comm": upfront, "computed": computed})
