"""minidist.checks.lab4_pipeline: the library's own schedules and executor pass; typical
student mistakes fail with a message that says what is wrong."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.checks import lab4_pipeline as C
from minidist.pipeline import Action, Schedule, make, run_schedule, with_comms


@pytest.fixture(autouse=True)
def _library_answers_allowed(monkeypatch):
    """These tests hand minidist's own schedules and executor to the lab checks, which must accept
    them: the refusal of library answers (tests/test_library_answers.py) is off here, in every
    registered check and in the demo's launch."""
    off = lambda check: dataclasses.replace(check, refusal=None)      # noqa: E731
    for name, (stub, checks, by) in list(C.CHECKS.entries.items()):
        allowed = ({k: tuple(map(off, c)) for k, c in checks.items()} if by else off(checks))
        monkeypatch.setitem(C.CHECKS.entries, name, (stub, allowed, by))
    monkeypatch.setattr(C, "REFUSED", None)


SCHEDULE = {"gpipe": C.check_gpipe_schedule, "1f1b": C.check_one_f_one_b_schedule}


def library_step(s, chunks, x, y, loss_fn=F.mse_loss, costs=None):
    """minidist's executor as a student's. At p = 1 (one stage on rank 0 of a larger launch, the
    visible case of "everything from the schedule") the library wants a group of one rank, which
    the launch's other ranks cannot make with it: the stage runs its m micro-batches here, each
    loss scaled by 1/m, as the library does."""
    if s.p > 1:
        return run_schedule(s, chunks, x, y, loss_fn=loss_fn, costs=costs).loss
    loss = 0.0
    for xb, yb in zip(x.chunk(s.m), y.chunk(s.m)):
        part = loss_fn(chunks[0](xb), yb) / s.m
        part.backward()
        loss += part.item()
    return loss


def lib_exec(s, chunks, x, y, costs=None):
    return library_step(s, chunks, x, y, costs=costs)


def unscaled_exec(s, chunks, x, y, costs=None):
    """The library's executor with the 1/m loss scaling undone: gradients m times too large."""
    return library_step(s, chunks, x, y, loss_fn=lambda out, t: F.mse_loss(out, t) * s.m, costs=costs)


def hoarding_exec(s, chunks, x, y, costs=None):
    """Keeps every micro-batch's graph alive (retain_graph=True, outputs kept) until the step ends."""
    keep, backward = [], torch.autograd.backward

    def forward(inp, _c=chunks[0]):
        out = _c(inp)
        keep.append(out)
        return out
    torch.autograd.backward = lambda t, g=None, **kw: backward(t, g, retain_graph=True)
    try:
        return run_schedule(s, [_Wrap(forward)], x, y, costs=costs).loss
    finally:
        torch.autograd.backward = backward


class _Wrap(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_library_schedules_pass(kind):
    SCHEDULE[kind](lambda p, m: make(kind, p, m), hidden=False)
    SCHEDULE[kind](lambda p, m: make(kind, p, m), hidden=True)


def _one_f_one_b_warmup(extra):
    def sched(p, m):
        order = []
        for r in range(p):
            w = min(p - r - 1 + extra, m)
            acts = [Action("F", i) for i in range(w)]
            for i in range(m - w):
                acts += [Action("F", i + w), Action("B", i)]
            acts += [Action("B", i) for i in range(m - w, m)]
            order.append(acts)
        return with_comms("1f1b", p, m, 1, order)
    return sched


def test_wrong_warmup_is_named():
    with pytest.raises(AssertionError, match="warmup"):
        C.check_one_f_one_b_schedule(_one_f_one_b_warmup(1))


def test_gpipe_one_microbatch_at_a_time_fails_on_order_or_bubble():
    def seq(p, m):
        return with_comms("gpipe", p, m, 1, [[a for i in range(m) for a in (Action("F", i), Action("B", i))]
                                             for _ in range(p)])
    with pytest.raises(AssertionError, match="compute order"):
        C.check_gpipe_schedule(seq)


def test_invalid_schedule_reports_the_validator():
    def no_recv(p, m):
        s = make("gpipe", p, m)
        s.actions = [[a for a in prog if a.kind != "RECV_F"] for prog in s.actions]
        return s
    with pytest.raises(AssertionError, match="not a valid schedule"):
        C.check_gpipe_schedule(no_recv)
    with pytest.raises(AssertionError, match="expected a minidist.pipeline.Schedule"):
        C.check_gpipe_schedule(lambda p, m: make("gpipe", p, m).actions)
    with pytest.raises(AssertionError, match="m=1"):
        C.check_gpipe_schedule(lambda p, m: make("naive", p, 1))
    assert isinstance(make("gpipe", 2, 2), Schedule)


def test_executor_checks():
    C.check_run_pipeline(lib_exec)
    with pytest.raises(AssertionError, match="scaled by 1/m"):
        C.check_run_pipeline(unscaled_exec)


def test_memory_check_measures_what_autograd_keeps():
    C.check_run_pipeline_memory(lib_exec)
    with pytest.raises(AssertionError, match="micro-batches at the peak|whose backward had already run"):
        C.check_run_pipeline_memory(hoarding_exec)


def early_receive_exec(s, chunks, x, y, costs=None):
    """Waits for every forward activation it will receive before its first forward (GPipe):
    right gradients and memory, but the pipeline stalls; the wall-clock bubble would show it
    only on a quiet machine, the replayed order shows it always."""
    if s.name.startswith("gpipe"):
        actions = []
        for prog in s.actions:
            recvs = [a for a in prog if a.kind == "RECV_F"]
            rest = [a for a in prog if a.kind != "RECV_F"]
            actions.append(recvs + rest)
        s = Schedule(s.name, s.p, s.m, s.v, actions)
    return run_schedule(s, chunks, x, y, costs=costs).loss


def test_bubble_is_graded_from_the_replayed_order_not_the_clock():
    rows = C.measure_executor(lib_exec, 4, [("gpipe", 8, 32), ("1f1b", 8, 32)], sleep=False)
    assert all(abs(r["replayed"] - r["simulated"]) < 1e-9 and r["measured"] is None for r in rows), rows
    with pytest.raises(AssertionError, match=r"replayed in its own order .* bubble of 0\.\d+; the schedule's is 0\.273"):
        C.check_run_pipeline_memory(early_receive_exec)


def buffer_keeping_exec(s, chunks, x, y, costs=None):
    """The library's executor on stages whose inputs and outputs are kept in a list until the step ends
    (no retain_graph: autograd frees what it saved, the executor's own references stay)."""
    keep = []

    def forward(inp, _c=chunks[0]):
        out = _c(inp)
        keep.append((inp, out))
        return out
    return run_schedule(s, [_Wrap(forward)], x, y, costs=costs).loss


def test_memory_check_counts_what_the_executor_keeps_after_a_backward():
    with pytest.raises(AssertionError, match=r"gpipe\(p=4, m=8\): when the backward of micro-batch \d began, "
                                             r"rank 0 still held the stage input or output of 7 micro-batches"):
        C.check_run_pipeline_memory(buffer_keeping_exec)


def consuming_exec(s, chunks, x, y, costs=None):
    """Runs the schedule, then empties this rank's action list: a second step with it does nothing."""
    loss = library_step(s, chunks, x, y, costs=costs)
    s.actions[dist.get_rank()].clear()
    return loss


def no_loss_at_p1_exec(s, chunks, x, y, costs=None):
    """The loss computed only on a stage that is not also the first (an elif after stage 0's branch): at
    p = 1 the gradients are right and no loss comes back."""
    if s.p > 1:
        return run_schedule(s, chunks, x, y, costs=costs).loss
    for xb, yb in zip(x.chunk(s.m), y.chunk(s.m)):
        (F.mse_loss(chunks[0](xb), yb) / s.m).backward()
    return None


def test_executor_is_run_twice_per_schedule_and_at_p1():
    with pytest.raises(AssertionError, match=r"gpipe\(p=2, m=2\), batch of 8: on rank 0, the schedule it was given "
                                             r"changed during the call"):
        C.check_run_pipeline(consuming_exec)
    with pytest.raises(AssertionError, match=r"1f1b\(p=1, m=4\), batch of 8: the last stage \(rank 0\) returned "
                                             r"loss None.*both the first and the last"):
        C.check_run_pipeline(no_loss_at_p1_exec, hidden=True)
