"""outputs_at_wait: an asynchronous operation's output lands when its handle is waited for, never earlier.

Each case also holds without the mode in a correct program; the mode only removes the luck an
incorrect one relies on (an unwaited handle whose operation happened to finish first).
"""
import time

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.checks.kit.launch import launch_named, mark_case
from minidist.runtime.strict_async import outputs_at_wait
from minidist.trace import trace

SETTLE = 0.2     # long enough for gloo to finish tiny operations: without the mode their outputs would be there


def _async_cases():
    rank, n = dist.get_rank(), dist.get_world_size()
    total = sum(range(1, n + 1))
    seen = {}
    with outputs_at_wait(), trace() as t:
        x = torch.full((4,), float(rank + 1))
        work = dist.all_reduce(x, async_op=True)
        x += 100                                      # touched after launch: the input was read at launch
        time.sleep(SETTLE)
        seen["all_reduce before wait"] = x.tolist()
        work.wait()
        seen["all_reduce after wait"] = x.tolist()

        a, b = torch.full((3,), float(rank + 1)), torch.full((3,), float(rank + 1))
        wa, wb = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
        wb.wait()
        time.sleep(SETTLE)
        seen["first of two, only the second waited"] = a.tolist()
        wa.wait()

        y = torch.full((2,), float(rank + 1))
        doubled = dist.all_reduce(y, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait()
        seen["future chain"], seen["after future"] = doubled.tolist(), y.tolist()

        z = torch.full((2,), float(rank + 1))
        w = dist.all_reduce(z, async_op=True)
        while not w.is_completed():
            time.sleep(0.001)
        seen["after is_completed"] = z.tolist()

        out = torch.zeros(2 * n)
        w = dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), async_op=True)
        time.sleep(SETTLE)
        seen["all_gather before wait"] = out.tolist()
        w.wait()
        seen["all_gather after wait"] = out.tolist()

        got = torch.full((2,), -1.0)
        reqs = [dist.isend(torch.full((2,), float(rank)), (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]
        time.sleep(SETTLE)
        seen["irecv before wait"] = got.tolist()
        for req in reqs:
            req.wait()
        seen["irecv after wait"] = got.tolist()

        batched = torch.full((2,), -1.0)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % n),
                                           dist.P2POp(dist.irecv, batched, (rank - 1) % n)]):
            req.wait()
        seen["batch_isend_irecv"] = batched.tolist()

        s = torch.full((2,), float(rank + 1))
        dist.all_reduce(s)
        seen["blocking all_reduce"] = s.tolist()
    return seen, total, [(e.op, e.nbytes) for e in t.comm()]


def test_outputs_land_at_wait_and_inputs_are_read_at_launch():
    n = 2
    for rank, (seen, total, events) in enumerate(minidist.launch(_async_cases, n)):
        prev = float((rank - 1) % n)
        assert seen["all_reduce before wait"] == [rank + 101.0] * 4
        assert seen["all_reduce after wait"] == [float(total)] * 4          # the +100 came after the launch
        assert seen["first of two, only the second waited"] == [rank + 1.0] * 3
        assert seen["future chain"] == [2.0 * total] * 2 and seen["after future"] == [float(total)] * 2
        assert seen["after is_completed"] == [float(total)] * 2
        assert seen["all_gather before wait"] == [0.0] * 2 * n
        assert seen["all_gather after wait"] == [float(r) for r in range(n) for _ in range(2)]
        assert seen["irecv before wait"] == [-1.0] * 2 and seen["irecv after wait"] == [prev] * 2
        assert seen["batch_isend_irecv"] == [prev] * 2
        assert seen["blocking all_reduce"] == [float(total)] * 2
        # the tracer still sees the caller's payloads
        assert events[0] == ("all_reduce", 16) and ("all_gather_into_tensor", 8) in events


def _leaves_a_handle(progress, cases):
    for case in cases:
        mark_case(progress, case)
        x = torch.ones(3)
        if case == "second case":
            dist.all_reduce(x, async_op=True)         # never waited for
    mark_case(progress, "after the cases")


def test_an_unwaited_handle_fails_naming_the_case_the_operation_and_the_line():
    with pytest.raises(AssertionError) as err:
        launch_named(_leaves_a_handle, 2, ["first case", "second case", "third case"], name="probe", timeout=30)
    msg = str(err.value)
    assert "second case" in msg and "never waited for" in msg
    assert "1 × all_reduce (test_strict_async.py:" in msg


def _unwaited_without_the_mode(progress):
    work = dist.all_reduce(torch.ones(3), async_op=True)
    mark_case(progress, "next case")
    return work.wait()


def test_without_the_mode_nothing_is_rewritten_or_tracked():
    assert launch_named(_unwaited_without_the_mode, 2, name="probe", timeout=30, outputs_at_wait=False) == [True] * 2
