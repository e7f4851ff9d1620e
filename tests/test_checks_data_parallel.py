"""minidist.checks.lab2_data_parallel and lab3_zero_fsdp: the library's own implementations pass, typical mistakes fail with
a message that says what is wrong."""
import dataclasses
import inspect
import json
import os

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT
from minidist.checks import lab2_data_parallel as lab2
from minidist.checks import lab3_zero_fsdp as lab3
from minidist.checks.kit.run import StudentRaised
from minidist.checks.lab3_zero_fsdp import cases as lab3_cases
from minidist.checks.lab3_zero_fsdp import given as lab3_given
from minidist.checks.lab3_zero_fsdp import stand_ins as lab3_stand_ins
from minidist.data_parallel import BucketedDDP, NaiveDDP, make_buckets
from minidist.harness.data_parallel import step_time_vs_bucket_size


def _without_refusal(monkeypatch, lab):
    """Every check of ``lab`` with nothing refused, as its public functions run it (the registry's entries)."""
    off = lambda check: dataclasses.replace(check, refusal=None)      # noqa: E731
    for name, (stub, checks, by) in list(lab.CHECKS.entries.items()):
        if isinstance(checks, dict):
            checks = {k: tuple(map(off, v)) if isinstance(v, tuple) else off(v) for k, v in checks.items()}
        else:
            checks = tuple(map(off, checks)) if isinstance(checks, tuple) else off(checks)
        monkeypatch.setitem(lab.CHECKS.entries, name, (stub, checks, by))


@pytest.fixture(autouse=True)
def _library_answers_allowed(monkeypatch):
    """These tests hand minidist's own implementations to the lab checks, which must accept them:
    the refusal of library answers (tests/test_library_answers.py) is off here."""
    _without_refusal(monkeypatch, lab2)
    _without_refusal(monkeypatch, lab3)


def good_split(x, y, rank, world_size):
    if x.shape[0] % world_size:
        raise ValueError("uneven")
    n = x.shape[0] // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def test_split_check_accepts_contiguous_blocks_and_rejects_the_rest():
    lab2.check_split_batch(good_split, hidden=True)
    with pytest.raises(AssertionError, match="contiguous"):
        lab2.check_split_batch(lambda x, y, r, n: (x[r::n], y[r::n]))
    with pytest.raises(AssertionError, match="ValueError"):
        lab2.check_split_batch(lambda x, y, r, n: (x[r * (len(x) // n):(r + 1) * (len(x) // n)],
                                                        y[r * (len(x) // n):(r + 1) * (len(x) // n)]))


def test_bucket_check_accepts_the_library_and_rejects_forward_order():
    lab2.check_make_buckets(make_buckets, hidden=True)
    with pytest.raises(AssertionError, match="REVERSE"):
        lab2.check_make_buckets(lambda ps, cap: [list(b)[::-1] for b in make_buckets(ps, cap)][::-1])


def test_split_and_bucket_checks_fail_a_function_that_changes_the_callers_tensors():
    def split_then_clear(x, y, r, n):        # right slices, then the caller's batch is overwritten
        xs, ys = good_split(x.clone(), y.clone(), r, n)
        x.zero_()
        return xs, ys

    def buckets_then_clear(params, cap):
        with torch.no_grad():
            params[0].zero_()
        return make_buckets(params, cap)
    with pytest.raises(AssertionError, match="the caller's x changed during split_batch"):
        lab2.check_split_batch(split_then_clear)
    with pytest.raises(AssertionError, match="changed the values of the parameters"):
        lab2.check_make_buckets(buckets_then_clear)


def library_average(model):
    NaiveDDP(model, broadcast_from=None).sync_gradients()


def summed(model):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def test_average_checks_accept_the_library():
    lab2.check_average_gradients(library_average, hidden=True)
    lab2.check_average_gradients_traffic(library_average)


def test_average_checks_diagnose_a_missing_sync_and_a_missing_division():
    with pytest.raises(AssertionError, match="never synchronised"):
        lab2.check_average_gradients(lambda model: None)
    with pytest.raises(AssertionError, match="summed instead of averaged"):
        lab2.check_average_gradients(summed)
    with pytest.raises(AssertionError, match="only all_reduce"):
        lab2.check_average_gradients_traffic(lambda model: None)


def test_bucketed_checks_accept_the_library_ddp():
    # the library's BucketedDDP syncs at the end of backward; its finish_gradient_sync() is then a no-op
    lab2.check_bucketed_ddp(BucketedDDP, hidden=True)
    lab2.check_bucketed_ddp_traffic(BucketedDDP)
    lab2.check_bucketed_ddp_overlap(BucketedDDP)


class SyncAfterBackward:
    """Right numbers, one all-reduce per bucket, but everything after backward."""

    def __init__(self, model, bucket_cap_bytes):
        self.model = model
        self.buckets = make_buckets([p for p in model.parameters() if p.requires_grad], bucket_cap_bytes)

    def __call__(self, x):
        return self.model(x)

    def finish_gradient_sync(self):
        n = dist.get_world_size()
        for b in self.buckets:
            for p in b:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in b]) / n
            dist.all_reduce(flat)
            offset = 0
            for p in b:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def test_overlap_check_rejects_sync_after_backward_but_equality_accepts_it():
    lab2.check_bucketed_ddp(SyncAfterBackward)
    lab2.check_bucketed_ddp_traffic(SyncAfterBackward)
    with pytest.raises(AssertionError, match="before backward produced its last gradient"):
        lab2.check_bucketed_ddp_overlap(SyncAfterBackward)


def test_step_time_rows():
    rows = step_time_vs_bucket_size(BucketedDDP, [1024, 1 << 20], steps=2,
                                              model_kwargs={"hidden": 16})
    assert [r["cap"] for r in rows] == [1024, 1 << 20]
    assert rows[0]["buckets"] > rows[1]["buckets"] == 1 and all(r["step_ms"] > 0 for r in rows)


def test_nan_parameters_fail_the_equality_check():
    def nan_grads(model):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(AssertionError, match="nan"):
        lab2.check_average_gradients(nan_grads)


# ----------------------------------------------------------------------------- lab 3 checks
class LibZero:
    """The lab 3 wrapper interface on top of minidist's own ZeRO-1/2 and FSDP."""

    def __init__(self, model, stage, optimizer="adam", lr=1e-2):
        from minidist.data_parallel import FullyShardedDataParallel, ZeroDataParallel
        cls = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        kw = {"lr": lr} | ({"momentum": 0.9} if optimizer == "sgd" else {})
        self.model, self.stage = model, stage
        self.w = (ZeroDataParallel(model, stage, cls, bucket_cap_bytes=1 << 12, **kw) if stage < 3
                  else FullyShardedDataParallel(model, optimizer_cls=cls, **kw))
        self.optimizer = self.w.optimizer

    def __call__(self, x):
        return self.w(x)

    def finish_backward(self):
        pass

    def step(self):
        self.w.step()

    def zero_grad(self):
        self.w.zero_grad()

    def state_tensors(self):
        return self.w.state_tensors()

    def full_parameters(self):
        from minidist.models import flat_parameters
        if self.stage < 3:
            return flat_parameters(self.model)
        with self.w.summon_full_params():
            return flat_parameters(self.model)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_checks_accept_the_library(stage):
    lab3.check_zero(LibZero, stage=stage)
    lab3.check_zero_traffic(LibZero, stage=stage)
    if stage > 1:
        lab3.check_zero_memory(LibZero, stage=stage)
        return
    # The library's ZeRO-1 keeps one flat full-gradient buffer per bucket from step to step (backward
    # accumulates into it in place); the lab's Zero drops every full gradient once reduce-scattered. Next
    # to the lab's reference measured on the same rank, that buffer is the model-sized copy the rule catches.
    with pytest.raises(AssertionError, match=r"rank \d: throughout a training step .* holds \d+ bytes more than "
                                             r"the lab's reference \([01]\.\d\d× the parameters'"):
        lab3.check_zero_memory(LibZero, stage=stage)


def test_zero_memory_check_rejects_an_unsharded_stage():
    unsharded = lambda model, stage, **kw: LibZero(model, 1, **kw)     # noqa: E731  (claims 3, is 1)
    with pytest.raises(AssertionError, match="Full gradients must be dropped"):
        lab3.check_zero_memory(unsharded, stage=3)
    with pytest.raises(AssertionError, match="1.5x|2× the parameters|expected 2×"):
        lab3.check_zero_traffic(unsharded, stage=3)


def test_the_reference_zero_is_the_notebooks_given_classes():
    """The memory check measures the lab's reference Zero before the student's, on the same rank: it is
    the notebook's given ShardedUnit and Zero, word for word (on the library's stand-ins for the four functions)."""
    with open(os.path.join(ROOT, "solutions", "lab3_zero_fsdp", "lab3_zero_fsdp.ipynb")) as f:
        cells = json.load(f)["cells"]
    given = {c["metadata"].get("nbgrader", {}).get("grade_id"): "".join(c["source"]).strip() for c in cells}
    assert inspect.getsource(lab3_given.ShardedUnit).strip() == given["given_ShardedUnit"]
    assert inspect.getsource(lab3_given.Zero).strip() == given["given_Zero"]


def _functions_the_given_zero_calls(stages) -> dict:
    """Inside a rank: for each stage, the names of the lab's four functions the given Zero calls in one
    training step (a TinyMLP with a layer its forward never uses, full_parameters() included)."""
    from minidist.models import TinyMLP, local_slice, mlp_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        called = set()
        originals = dict(lab3_stand_ins.BY_NAME)

        def recorded(name, fn):
            def call(*args):
                called.add(name)
                return fn(*args)
            return call
        for name, fn in originals.items():
            setattr(lab3_given, name, recorded(name, fn))
        try:
            zero = lab3_given.Zero(TinyMLP(unused=True), stage)
            x, y = mlp_batch(0, 8)
            torch.nn.functional.mse_loss(zero(local_slice(x, rank, world)), local_slice(y, rank, world)).backward()
            zero.finish_backward()
            zero.step()
            zero.zero_grad()
            zero.full_parameters()
        finally:
            for name, fn in originals.items():
                setattr(lab3_given, name, fn)
        out[stage] = sorted(called)
    return out


def test_each_stage_stands_in_only_for_the_functions_the_given_zero_calls_there():
    """A stand-in is allowed in graded code where it stands in: the stages' CALLED lists are what the given
    Zero really calls, so no stage allows one it never needs (ZeRO-3's sharded_step would all-gather for
    gather_parameters)."""
    import minidist
    assert all(set(lab3_cases.GRADED[s]) <= set(lab3_cases.CALLED[s]) for s in lab3_cases.GRADED)
    per_rank = minidist.launch(_functions_the_given_zero_calls, 2, list(lab3_cases.GRADED), timeout=60)
    for got in per_rank:
        assert got == {stage: sorted(lab3_cases.CALLED[stage]) for stage in lab3_cases.GRADED}, got


UNAVERAGED_REDUCE_SCATTER = """
def reduce_scatter_gradients(unit):
    flat_grad = unit.layout.flatten([p.grad for p in unit.params], like=unit.shard)
    mine = flat_grad.new_empty(unit.shard.shape)
    dist.reduce_scatter_tensor(mine, flat_grad)          # the sum over ranks, never divided by N
    unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
    for p in unit.params:
        p.grad = None
"""


def test_each_stage_grades_its_functions_and_the_reference_stands_in_for_the_others():
    """A notebook whose reduce_scatter_gradients forgets to average: ZeRO-2 grades it and fails; ZeRO-1 grades
    sharded_step alone, the library's stand-ins for the rest in the rank's copy of the notebook's globals.
    (The notebook's other functions here are the stand-ins' source: nothing is refused in this file.)"""
    notebook = {"__name__": "__main__"}
    exec(compile(inspect.getsource(lab3_given), "<notebook cell>", "exec"), notebook)
    exec(compile(inspect.getsource(lab3_stand_ins), "<notebook cell>", "exec"), notebook)
    exec(compile(UNAVERAGED_REDUCE_SCATTER, "<notebook cell>", "exec"), notebook)
    lab3.check_zero(notebook["Zero"], stage=1)
    with pytest.raises(AssertionError, match=r"Zero\(stage=2\), grading your reduce_scatter_gradients .* rank 0's "
                                             r"parameter vector differs from single-process training"):
        lab3.check_zero(notebook["Zero"], stage=2)


def test_a_students_own_assert_reads_as_theirs():
    def asserting(params, cap_bytes):
        assert cap_bytes > 10 ** 9, "my own sanity check"
    with pytest.raises(StudentRaised, match=r"^make_buckets \(.*\): make_buckets raised AssertionError itself "
                                            r"\(test_checks_data_parallel.py, line \d+\).*my own sanity check") as err:
        lab2.check_make_buckets(asserting)      # the case first, then the student's line and words
    assert err.value.raised == "StudentAssertion"


# ----------------------------------------------------------------------------- correct alternatives
# Other implementations the labs' contracts allow live in the bug banks (ALTERNATIVES in
# solutions/lab2_data_parallel/bugbank.py and solutions/lab3_zero_fsdp/bugbank.py), where the selftest
# grades them as submissions.
