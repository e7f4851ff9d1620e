"""What a GPU node changes, emulated on CPU: NCCL's one handle per batch_isend_irecv, a wait()
that returns before the data land, and NCCL's error wording.

Each emulation is the strict legal extreme of the CUDA behaviour, so correct code gives the
reference result under it and code that leans on CPU luck (a handle per op, wait() meaning
"landed") gets a wrong result or a named error.
"""
import contextlib
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from minidist.checks.kit.launch import launch_named, mark_case
from minidist.models import block_stack, regression_batch
from minidist.pipeline import make, partition, rank_chunks, run_schedule
from minidist.runtime.strict_async import coalesced_batches, host_does_not_wait, outputs_at_wait
from minidist.trace import CommTimeout, PeerGone, explain, trace

WIDTH, BATCH, M = 8, 16, 4
SCHEDULES = ("1f1b", "gpipe")


def _model(p):
    return block_stack(2 * p + 1, WIDTH, seed=p)


# ----------------------------------------------------------------- one work per batch (NCCL)
def _coalesced_pipeline(p):
    import minidist.pipeline.executor as ex
    ex.ALWAYS_BATCH = True               # the NCCL path: every multi-message group is one batch
    rank, out = dist.get_rank(), {}
    x, y = regression_batch(BATCH, WIDTH)
    with coalesced_batches(), trace() as t:
        probe = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % p),
                                        dist.P2POp(dist.irecv, torch.empty(2), (rank - 1) % p)])
        out["handles per batch"] = len(probe)
        probe[0].wait()
        for name in SCHEDULES:
            for host in ("host waits", "host does not wait"):      # the latter: all of a GPU node at once
                chunks = rank_chunks(partition(_model(p), p), p, rank)
                with host_does_not_wait() if host == "host does not wait" else contextlib.nullcontext():
                    stats = run_schedule(make(name, p, M), chunks, x, y)
                out[name, host] = ([q.grad.clone() for c in chunks for q in c.parameters()], stats.loss)
    out["received"] = t.bytes_received()
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_the_executor_waits_for_one_handle_per_batch_as_nccl_returns(p):
    results = minidist.launch(_coalesced_pipeline, p, p, timeout=120)
    model = _model(p)
    x, y = regression_batch(BATCH, WIDTH)
    ref_loss = F.mse_loss(model(x), y)
    ref_loss.backward()
    for rank, out in enumerate(results):
        assert out["handles per batch"] == 1
        assert out["received"] > 0
        ref = [q.grad for q in rank_chunks(partition(model, p), p, rank)[0].parameters()]
        for key in [(name, host) for name in SCHEDULES for host in ("host waits", "host does not wait")]:
            grads, loss = out[key]
            assert max((g - r).abs().max().item() for g, r in zip(grads, ref)) <= 1e-5, (rank, key)
            if rank == p - 1:
                assert loss == pytest.approx(ref_loss.item(), abs=1e-5)


# ----------------------------------------------------------------- wait() returns before the data land
def _host_does_not_wait():
    rank, n = dist.get_rank(), dist.get_world_size()
    total, prev = float(sum(range(1, n + 1))), float((rank - 1) % n)
    seen = {}
    with outputs_at_wait(), host_does_not_wait():
        x = torch.full((3,), float(rank + 1))
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        with torch._C.DisableTorchFunction():      # a look past the emulated stream: not landed yet
            seen["raw after wait"] = x.tolist()
        seen["used after wait"] = (x * 1).tolist()   # the next op is ordered after the data

        parts = [torch.zeros(2) for _ in range(n)]
        dist.all_gather(parts, torch.full((2,), float(rank)), async_op=True).wait()
        seen["all_gather"] = torch.cat(parts).tolist()

        got = torch.full((2,), -1.0)
        reqs = [dist.isend(torch.full((2,), float(rank)), (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]
        for r in reqs:
            r.wait()
        seen["irecv"] = got.tolist()

        y = torch.full((2,), float(rank + 1))
        seen["future"] = dist.all_reduce(y, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait().tolist()

        z = torch.full((2,), float(rank + 1))
        pending = dist.all_reduce(z, async_op=True)
        pending.wait()                # nothing reads z in this block: it lands when the block ends
    seen["landed at the end"] = z.tolist()

    in_thread = {}

    def other_thread():               # no emulation there: its wait() blocks, as on a CPU
        w = torch.full((2,), float(rank + 1))
        dist.all_reduce(w, async_op=True).wait()
        with torch._C.DisableTorchFunction():
            in_thread["raw after wait"] = w.tolist()

    with outputs_at_wait(), host_does_not_wait():
        helper = threading.Thread(target=other_thread)
        helper.start()
        helper.join()
    seen["other thread"] = in_thread["raw after wait"]
    return seen, total, prev


def test_wait_returns_before_the_data_land_and_correct_code_stays_correct():
    for rank, (seen, total, prev) in enumerate(minidist.launch(_host_does_not_wait, 2)):
        assert seen["raw after wait"] == [rank + 1.0] * 3        # wait() returned, the data had not landed
        assert seen["used after wait"] == [total] * 3
        assert seen["all_gather"] == [float(r) for r in range(2) for _ in range(2)]
        assert seen["irecv"] == [prev] * 2
        assert seen["future"] == [2 * total] * 2
        assert seen["landed at the end"] == [total] * 2
        assert seen["other thread"] == [total] * 2


def _unwaited_without_host_wait(progress):
    mark_case(progress, "the waited one")
    with host_does_not_wait():
        a = torch.ones(2)
        dist.all_reduce(a, async_op=True).wait()
        mark_case(progress, "the forgotten one")
        dist.all_reduce(torch.ones(3), async_op=True)            # never waited for


def test_an_unwaited_handle_is_still_named_when_the_host_does_not_wait():
    with pytest.raises(AssertionError) as err:
        launch_named(_unwaited_without_host_wait, 2, name="probe", timeout=30)
    msg = str(err.value)
    assert "the forgotten one" in msg and "1 × all_reduce (test_cuda_semantics.py:" in msg


# ----------------------------------------------------------------- NCCL's wording
NCCL_TIMEOUTS = [
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=RECV, NumelIn=1024, "
    "NumelOut=1024, Timeout(ms)=1500) ran for 1503 milliseconds before timing out.",
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Work WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, "
    "Timeout(ms)=600000) timed out in blocking wait.",
    "NCCL communicator was aborted on rank 0. Original reason for failure was: [Rank 0] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=2, OpType=SEND) ran for 600081 milliseconds before timing out.",
    "Timed out waiting 1500ms for recv operation to complete",                                   # gloo
]
NCCL_PEER_GONE = [
    "NCCL error in: ProcessGroupNCCL.cpp:2010, remote process exited or there was a network error, NCCL "
    "version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.",
    "NCCL communicator was aborted on rank 1. ",
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
]


@pytest.mark.parametrize("message", NCCL_TIMEOUTS)
def test_nccl_and_gloo_timeouts_name_the_op(message):
    clearer = explain(RuntimeError(message), "recv(src=0, 4.0 KiB)")
    assert isinstance(clearer, CommTimeout)
    assert str(clearer).startswith("recv(src=0, 4.0 KiB) did not complete before the process-group timeout")


@pytest.mark.parametrize("message", NCCL_PEER_GONE)
def test_a_vanished_peer_is_said_as_such(message):
    clearer = explain(RuntimeError(message), "all_reduce(16 B)")
    assert isinstance(clearer, PeerGone)
    assert str(clearer) == ("all_reduce(16 B) failed: a peer rank exited (returned or crashed) "
                            "before the matching call")


def test_other_errors_are_left_as_they_are():
    assert explain(RuntimeError("CUDA error: an illegal memory access was encountered"), "send(dst=1, 4 B)") is None
