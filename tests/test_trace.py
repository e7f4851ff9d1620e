"""The tracer: bytes, peers and ops of known patterns, guards, and exports."""
import json
import re

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.trace import ForbiddenOperation, api, guard, merge, span, trace


def ring_shift(numel):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty(numel)
    with trace() as t:
        reqs = [dist.isend(torch.full((numel,), float(rank)), (rank + 1) % n),
                dist.irecv(out, (rank - 1) % n)]
        for r in reqs:
            r.wait()
        dist.barrier()
    return t, out


def test_ring_shift_bytes_and_peers():
    n, numel = 4, 1000
    results = minidist.launch(ring_shift, n, numel)
    whole = merge(t for t, _ in results)
    for rank, (t, out) in enumerate(results):
        assert torch.equal(out, torch.full((numel,), float((rank - 1) % n)))
        assert t.bytes_sent() == numel * 4 and t.bytes_received() == numel * 4
        assert t.peers_sent_to() == {(rank + 1) % n}
        assert t.peers_received_from() == {(rank - 1) % n}
        assert t.op_counts() == {"isend": 1, "irecv": 1, "barrier": 1}
        for e in t.events:
            assert e.end >= e.start and e.rank == rank and "test_trace.py" in e.where
    assert whole.edges() == {(r, (r + 1) % n): numel * 4 for r in range(n)}
    assert whole.ranks() == list(range(n))


def collectives_payloads():
    x = torch.ones(6)
    with trace() as t:
        dist.all_reduce(x)
        out = torch.empty(6 * dist.get_world_size())
        dist.all_gather_into_tensor(out, x)
        shard = torch.empty(3)
        dist.reduce_scatter_tensor(shard, torch.ones(3 * dist.get_world_size()))
        dist.broadcast(x, src=0)
        dist.all_gather(list(out.chunk(dist.get_world_size())), x)              # the list form, into views
        dist.all_gather(tensor_list=[torch.empty(6) for _ in range(dist.get_world_size())], tensor=x)
        objs = [None] * dist.get_world_size()
        dist.all_gather_object(objs, {"rank": dist.get_rank()})   # calls all_gather inside: counted once
    return [(e.op, e.nbytes) for e in t.events], objs


def gather_from_any_source():
    with trace() as t:
        if dist.get_rank() == 0:
            got = {dist.recv(torch.empty(3))}          # blocking: returns the sender
            work = dist.irecv(torch.empty(3))
            work.wait()
        else:
            dist.send(torch.ones(3), 0)
    return t, got if dist.get_rank() == 0 else None


def test_a_receive_from_any_source_records_who_sent():
    (t0, got), _, _ = minidist.launch(gather_from_any_source, 3)
    peers = [e.peer for e in t0.events if e.is_recv]
    assert sorted(peers) == [1, 2] and peers[0] in got          # each sender once, the blocking one first
    assert t0.peers_received_from(0) == {1, 2} and t0.bytes_received(0) == 2 * 12


def test_collectives_record_op_and_input_payload():
    events, objs = minidist.launch(collectives_payloads, 2)[0]
    assert events[:4] == [("all_reduce", 24), ("all_gather_into_tensor", 24),
                          ("reduce_scatter_tensor", 24), ("broadcast", 24)]
    # a list all_gather counts its input once, like the tensor form, not the N outputs it fills
    assert events[4:6] == [("all_gather", 24), ("all_gather", 24)]
    assert [op for op, _ in events[6:]] == ["all_gather_object"]
    assert objs == [{"rank": 0}, {"rank": 1}]


def subgroup_send():
    group = dist.new_group([1, 3])
    with trace() as t:
        if dist.get_rank() == 1:
            dist.send(torch.ones(5), group_dst=1, group=group)
        elif dist.get_rank() == 3:
            dist.recv(torch.empty(5), group_src=0, group=group)
    return [(e.op, e.peer, e.group) for e in t.events]


def test_subgroup_peers_are_global_ranks():
    out = minidist.launch(subgroup_send, 4)
    assert out[1] == [("send", 3, (1, 3))]
    assert out[3] == [("recv", 1, (1, 3))]
    assert out[0] == [] and out[2] == []


@api("fancy_all_reduce")
def fancy_all_reduce(x):
    dist.all_reduce(x)
    return x


def guarded_calls():
    seen = {}
    with guard(allow={"send", "recv", "isend", "irecv"}):
        for name, call in [("all_reduce", lambda: dist.all_reduce(torch.ones(1))),
                           ("minidist", lambda: fancy_all_reduce(torch.ones(1)))]:
            try:
                call()
                seen[name] = "allowed"
            except ForbiddenOperation as err:
                seen[name] = str(err)
        peer = 1 - dist.get_rank()
        reqs = [dist.isend(torch.ones(2), peer), dist.irecv(torch.empty(2), peer)]
        [r.wait() for r in reqs]
        seen["p2p"] = "allowed"
    dist.all_reduce(torch.ones(1))      # outside the guard: allowed again
    seen["after"] = "allowed"
    return seen


def test_guard_forbids_collectives_and_minidist_apis_but_not_p2p():
    seen = minidist.launch(guarded_calls, 2)[0]
    assert "all_reduce is not allowed here (test_trace.py:" in seen["all_reduce"]
    assert "send/recv" in seen["all_reduce"]
    assert seen["minidist"].startswith("minidist.fancy_all_reduce is not allowed here")
    assert seen["p2p"] == "allowed" and seen["after"] == "allowed"


def spans_and_batched_p2p():
    peer = 1 - dist.get_rank()
    with trace() as t:
        with span("F", mb=0):
            ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, torch.empty(3), peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        fancy_all_reduce(torch.ones(2))
    return t


def test_spans_api_regions_and_chrome_export(tmp_path):
    traces = minidist.launch(spans_and_batched_p2p, 2)
    t0 = traces[0]
    ops = [e.op for e in t0.events]
    assert "span:F" in ops and "api:fancy_all_reduce" in ops
    assert [(e.op, e.peer, e.nbytes) for e in t0.comm()][:2] == [("isend", 1, 12), ("irecv", 1, 12)]
    assert [e.meta for e in t0.events if e.op == "span:F"] == [{"mb": 0}]
    assert all(not e.op.startswith(("span:", "api:")) for e in t0.comm())
    path = tmp_path / "trace.json"
    merge(traces).to_chrome(str(path))
    doc = json.loads(path.read_text())
    assert {row["pid"] for row in doc["traceEvents"]} == {0, 1}         # one track per rank
    spans = [row for row in doc["traceEvents"] if row["ph"] == "X"]
    assert spans and all(row["dur"] >= 0 for row in spans)
    assert {row["name"] for row in spans if row["cat"] == "span"} == {"F"}


def test_trace_is_empty_outside_any_launch():
    with trace() as t:
        pass
    assert t.events == [] and t.bytes_sent() == 0


def send_to_self():
    dist.send(torch.ones(1), dst=dist.get_rank())


def test_sending_to_yourself_is_a_clear_error():
    with pytest.raises(minidist.LaunchError, match="a rank cannot send to itself"):
        minidist.launch(send_to_self, 2)


def isend_everyone_first_then_wait(n):
    rank = dist.get_rank()
    work = dist.isend(torch.ones(n), (rank + 1) % dist.get_world_size())
    work.wait()     # nobody posts a receive


def test_async_wait_timeout_names_the_op():
    with pytest.raises(minidist.LaunchError) as info:
        minidist.launch(isend_everyone_first_then_wait, 2, 1000, timeout=1.5)
    message = str(info.value)
    # whichever rank times out first names its own isend (the other may then see its peer gone)
    assert re.search(r"wait\(\) on isend\(dst=[01], 3\.9 KiB\)|isend\(dst=[01], 3\.9 KiB\) did not complete", message), message
    assert "Timed out waiting" not in message


# --------------------------------------------------------------------------- other threads
def _on_other_threads():
    import _thread
    import threading

    rank = dist.get_rank()
    model = torch.nn.Linear(4, 2, bias=False)
    model.weight.register_hook(lambda g: dist.all_reduce(g) or g)   # data parallelism's gradient sync
    x = torch.full((3, 4), float(rank + 1))
    out = {}

    def backward_on_a_thread(loss):
        errors = []

        def run():
            try:
                loss.backward()
            except Exception as err:     # noqa: BLE001  (reported to the main thread)
                errors.append(str(err))
        worker = threading.Thread(target=run)     # autograd's device threads on a GPU; this one here
        worker.start()
        worker.join()
        return errors

    with trace() as t:
        out["errors"] = backward_on_a_thread(model(x).sum())
    out["counted"] = [(e.op, e.nbytes) for e in t.comm()]
    out["grad"] = model.weight.grad.tolist()
    with guard():
        out["refused"] = backward_on_a_thread(model(x).sum())

    def raw_thread(results, done):
        try:
            dist.all_reduce(torch.ones(2))
            results.append("ran")
        except ForbiddenOperation as err:
            results.append(str(err))
        finally:
            done.release()

    for name, ctx in [("_thread traced", trace()), ("_thread guarded", guard())]:
        results, done = [], _thread.allocate_lock()
        done.acquire()
        with ctx as t:
            _thread.start_new_thread(raw_thread, (results, done))
            done.acquire()                # released by the thread when it is through
        out[name] = (results, [(e.op, e.nbytes) for e in t.comm()] if t is not None else None)
    return out


def test_traffic_on_other_threads_is_counted_and_guarded():
    for out in minidist.launch(_on_other_threads, 2):
        assert out["errors"] == [] and out["counted"] == [("all_reduce", 32)]
        assert out["grad"] == [[9.0] * 4] * 2           # 3 rows of (rank + 1), summed over ranks 0 and 1
        assert len(out["refused"]) == 1 and "all_reduce is not allowed here" in out["refused"][0]
        assert out["_thread traced"] == (["ran"], [("all_reduce", 8)])
        results, _ = out["_thread guarded"]
        assert len(results) == 1 and results[0].startswith("all_reduce is not allowed here (test_trace.py:")


def rank_1_returns_without_the_matching_send():
    if dist.get_rank() == 0:
        dist.recv(torch.empty(4), src=1)


def test_a_peer_that_returned_before_the_matching_call_is_said_as_such():
    with pytest.raises(minidist.LaunchError) as info:
        minidist.launch(rank_1_returns_without_the_matching_send, 2, timeout=20)
    message = str(info.value)
    assert "recv(src=1, 16 B) failed: a peer rank exited (returned or crashed) before the matching call" in message, message


def test_the_launcher_hears_the_op_a_thread_is_still_blocked_in():
    import threading
    from minidist.trace import state
    heard, saved = [], state.listener
    state.listener = heard.append
    try:
        blocked, done = threading.Event(), threading.Event()

        def stuck():                        # e.g. a backward hook's all_reduce waiting for its peer
            state.entered("all_reduce(64 B)")
            blocked.set()
            done.wait()
            state.left()
        worker = threading.Thread(target=stuck)
        worker.start()
        blocked.wait()
        state.entered("send(dst=1, 4 B)")   # the main thread's op comes and goes meanwhile
        state.left()
        after_main = heard[-1]
        done.set()
        worker.join()
    finally:
        state.listener = saved
    assert after_main == "all_reduce(64 B)" and heard[-1] is None
