"""Graded code cannot change a check's verdict by changing what the check computes it with.

A check compares in the same process as the graded code (on each rank, or in the process that
calls a pure check's function). In the grader's confirmation, every time a graded call returns, ``refusing`` puts back the
bindings of minidist, the checks and torch's functions (minidist/checks/bindings.py), before
the check computes anything with them, and the check fails naming what was rebound; a graded call
that returns a tensor subclass of its own fails, and a pure check's answer must be plain data
(minidist/checks/returned.py): an object of the student's class would answer the comparison
itself, outside the region where library answers are refused."""
import dataclasses
import sys

import pytest
import torch

import minidist.checks.lab4_pipeline as lab4
import minidist.checks.lab5_tensor_parallel as lab5
import minidist.checks.lab5_tensor_parallel.verdicts as lab5_verdicts
import minidist.checks.lab7_3d_parallel as lab7
from minidist import cost
from minidist.checks.kit.bindings import Snapshot
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refusal import Refusal
from minidist.checks.kit.returned import foreign_part
from minidist.pipeline import Schedule, gpipe

NOTHING = Refusal("nothing", ())


@pytest.fixture(autouse=True)
def guarded(monkeypatch):
    """As in the grader's confirmation (its runner sets MINIDIST_GUARD_BINDINGS=1); forked ranks inherit it."""
    import minidist.checks.kit.refusal as refusal
    monkeypatch.setattr(refusal, "GUARD_BINDINGS", True)


def rebinds_the_comparisons(x, group=None):
    """reduce_from_tp that does not reduce, and switches off lab 5's comparisons instead."""
    import minidist.checks.kit.compare as compare
    import minidist.checks.lab5_tensor_parallel.verdicts as verdicts
    verdicts.compared = lambda *a, **k: None
    verdicts.compare_traffic = lambda *a, **k: None
    compare.first = lambda problems: None
    return x.clone()


def rebinds_torch(x, group=None):
    torch.allclose = lambda *a, **k: True
    torch.Tensor.abs = lambda self: torch.zeros_like(self)
    return x.clone()


def restores_itself(x, group=None):
    """The comparison switched off until its first use, which puts the real one back: nothing is
    left rebound by the time the check ends."""
    import minidist.checks.lab5_tensor_parallel.verdicts as verdicts
    real = verdicts.compared

    def once(*a, **k):
        verdicts.compared = real
        return None
    verdicts.compared = once
    return x.clone()


@pytest.mark.parametrize("fn, rebound", [
    (rebinds_the_comparisons, "module minidist.checks.lab5_tensor_parallel.verdicts.compared"),
    (rebinds_torch, "module torch.allclose"),
    (restores_itself, "module minidist.checks.lab5_tensor_parallel.verdicts.compared"),
])
def test_a_rank_check_fails_graded_code_that_rebinds_its_comparisons(fn, rebound):
    # the forgery scored every test of labs 4-9 whose check compares inside the rank before
    with pytest.raises(AssertionError, match=f"rebound .*{rebound}.*as it found them"):
        lab5.check_reduce_from_tp(fn)


def test_a_pure_check_puts_the_bindings_back_before_comparing():
    real_allclose, real_compared = torch.allclose, lab5_verdicts.compared

    def graded():
        torch.allclose = lambda *a, **k: True
        lab5_verdicts.compared = None
        return torch.zeros(2)

    with pytest.raises(AssertionError, match=r"rebound .*torch\.allclose.*lab5_tensor_parallel\.verdicts\.compared"):
        graded_call(NOTHING, "graded", graded)
    assert torch.allclose is real_allclose and lab5_verdicts.compared is real_compared


def test_an_honest_graded_call_leaves_nothing_to_report():
    def graded(x):
        y = x.clone()
        y.add_(1)
        return torch.allclose(y, x + 1)
    assert graded_call(NOTHING, "graded", graded, torch.ones(3)) is True


def test_a_rank_check_fails_graded_code_that_loosens_a_tolerance():
    def loosens(x, group=None):
        import minidist.checks.kit.compare as compare
        import minidist.checks.lab5_tensor_parallel.cases as cases
        compare.TOLERANCE = dict.fromkeys(compare.TOLERANCE, 1e9)     # data, not code: public constants are watched too
        cases.TOL[torch.float64] = 1e9
        return x.clone()
    with pytest.raises(AssertionError, match=r"rebound module minidist\.checks\.kit\.compare\.TOLERANCE, contents of a "
                                             r"minidist table"):
        lab5.check_reduce_from_tp(loosens)


def test_the_snapshot_of_code_ignores_data_and_submodules():
    snap = Snapshot(code_only=True)
    device = sys.modules["minidist.runtime.device"]       # minidist.runtime.device is the function
    saved = device._rank_device
    try:
        device._rank_device = "somewhere"          # data the runtime updates: not watched
        assert snap.diff_and_restore() == []
    finally:
        device._rank_device = saved
    device.backend_for, real = (lambda kind: "gloo"), device.backend_for
    try:
        assert snap.diff_and_restore() == ["module minidist.runtime.device.backend_for"]
        assert device.backend_for is real
    finally:
        device.backend_for = real


def test_copying_a_library_object_is_no_change_but_forging_its_slot_names_is():
    """The first copy of a minidist object caches ``__slotnames__`` on its class (copyreg): lab 9's cases copy
    the library's plans for each caller, inside a test (the confirmation took lab 9's solution for a tamperer).
    That cache is no one's doing; a different value is."""
    import copy

    from minidist.expert_parallel.simulate import SimulatedDispatch
    if "__slotnames__" in SimulatedDispatch.__dict__:
        del SimulatedDispatch.__slotnames__
    snap = Snapshot()                  # the confirmation's, between tests: data is watched too
    copy.deepcopy(SimulatedDispatch(*[None] * len(SimulatedDispatch._fields)))
    assert "__slotnames__" in SimulatedDispatch.__dict__ and snap.diff_and_restore() == []
    SimulatedDispatch.__slotnames__ = ["forged"]
    try:
        assert snap.diff_and_restore() == ["class minidist.expert_parallel.simulate.SimulatedDispatch.__slotnames__"]
    finally:
        SimulatedDispatch.__slotnames__ = []


class Liar(torch.Tensor):
    """A tensor whose own code runs in every operation the check applies to it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def returns_its_own_tensor(x, group=None):
    return x.clone().as_subclass(Liar)


def test_a_rank_check_fails_a_tensor_subclass_of_the_students():
    with pytest.raises(AssertionError, match="returned a Liar, a torch.Tensor subclass of its own"):
        lab5.check_reduce_from_tp(returns_its_own_tensor)


class Agrees(float):
    """A number that is whatever it is compared with (the check's float() of it: the library's answer,
    computed where library answers are not refused)."""

    def __new__(cls, config, part):
        self = super().__new__(cls, 0.0)
        self.config, self.part = config, part
        return self

    def __float__(self):
        return float(cost.parallel3d.memory_per_rank(self.config)[self.part])


def predicts_nothing(config):
    return {k: Agrees(config, k) for k in ("params", "grads", "optimizer", "activations", "total")}


def test_a_pure_check_refuses_an_answer_of_the_students_own_class():
    with pytest.raises(AssertionError, match=r"predict_memory\(.*\) returned a Agrees: return plain values"):
        lab7.check_predict_memory(predicts_nothing)


class MySchedule(Schedule):
    pass


def test_a_schedule_must_be_minidists_own_not_a_subclass():
    ready = {(p, m): gpipe(p, m) for p, m in lab4.cases.SCHEDULE_CASES}     # made outside the graded call

    def gpipe_schedule(p, m):
        s = ready[p, m]
        return MySchedule(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})
    with pytest.raises(AssertionError, match="returned a MySchedule"):
        lab4.check_gpipe_schedule(gpipe_schedule)


def test_plain_data_is_plain_and_nothing_else_is():
    import numpy as np
    assert foreign_part({"a": [1, 2.5, np.float64(3), torch.ones(2), torch.nn.Parameter(torch.ones(1)), (None, "x")],
                         "s": torch.Size([2]), "d": torch.float16, "mm": torch.ones(3).max(0)}) is None
    assert foreign_part(gpipe(2, 2)) is None                        # minidist's own objects, made of plain data
    assert foreign_part([1, {"k": Agrees(None, "x")}]) == "a Agrees"
    assert foreign_part(torch.ones(1).as_subclass(Liar)) == "a Liar"


class NoDifference:
    """An output that is never far from what it is compared with (the comparison subtracts the
    expected value from it), and whose backward gives the expected gradient."""

    def __init__(self, x):
        self.x, self.shape, self.dtype = x, x.shape, x.dtype

    def detach(self):
        return self

    cpu = double = detach

    def __sub__(self, other):
        return torch.zeros_like(other)

    def __mul__(self, upstream):
        return self.x * upstream


def never_differs(x, group=None):
    import torch.distributed as dist
    dist.all_reduce(torch.zeros_like(x), group=group)          # the traffic the cost model expects
    return NoDifference(x)


def test_a_rank_check_compares_plain_tensors_only():
    # a judged runner's answer travels as plain data, which a NoDifference is not
    with pytest.raises(AssertionError, match=r"the graded code returned a NoDifference: return plain values"):
        lab5.check_reduce_from_tp(never_differs)
