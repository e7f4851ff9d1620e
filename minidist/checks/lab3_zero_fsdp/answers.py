"""Lab 3's answers: what the student's code did on every rank, as plain data (the only code of this
lab's checks that calls student code): ``reduce_scatter_gradients`` on one unit, and training with the
notebook's ``Zero`` (the library's stand-ins for the functions a stage does not grade: the kit
rebinds them in the rank's copy of the notebook's globals before the answer runs), traced and
measured. :func:`reference_live` measures the lab's reference (the given ``Zero`` on the library's
stand-ins) on the same rank first."""
from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.nn as nn

from minidist.checks.kit.compare import digest, on_rank, seeded
from minidist.checks.kit.run import mark
from minidist.checks.kit.training import student_trainer, trained
from minidist.checks.lab3_zero_fsdp.cases import GRADED, MEMORY_RUN, describe_memory, grad_seed, param_seed
from minidist.checks.lab3_zero_fsdp.given import ShardedUnit
from minidist.checks.lab3_zero_fsdp.given import Zero as ReferenceZero
from minidist.harness.data_parallel import train
from minidist.memory import CreatedBytes
from minidist.trace import trace


# ----------------------------------------------------------------------------- reduce_scatter_gradients
def unit(reduce_scatter_gradients, case) -> list[dict]:
    """Inside a rank: per unit, give one module seeded parameters (in the lab's given ``ShardedUnit``) and
    per-rank, per-micro-batch gradients (one of them missing), reduce-scatter twice, and record the shard's
    gradient and what else changed (the parameters as digests: they must come back unchanged)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for shapes, missing, dtype in case[1]:
        mark(f"a unit of parameters {shapes} in {dtype}, parameter {missing} without a gradient")
        module = nn.Module()
        for k, s in enumerate(shapes):
            module.register_parameter(f"p{k}", nn.Parameter(on_rank(seeded(s, param_seed(k), dtype))))
        unit = ShardedUnit(module, n, rank)
        with trace() as t:
            for micro in range(2):              # two micro-batches: the second call must add
                for k, p in enumerate(unit.params):
                    p.grad = None if k == missing else on_rank(seeded(p.shape, grad_seed(rank, k, micro), dtype))
                reduce_scatter_gradients(unit)
        shard_grad = None if unit.shard.grad is None else unit.shard.grad.clone()
        aliased = shard_grad is not None and (unit.shard.grad.untyped_storage().data_ptr()
                                              == unit.flat.untyped_storage().data_ptr())
        out.append({"shard_grad": shard_grad, "grads_left": [p.grad is not None for p in unit.params],
                    "aliased": aliased, "params": [digest(p) for p in unit.params],
                    "events": [(e.op, e.nbytes) for e in t.comm()], "padded": unit.layout.padded_numel,
                    "shard_numel": unit.layout.shard_numel})
    return out


# ----------------------------------------------------------------------------- Zero
def zero(Zero, case) -> list[dict]:
    """Inside a rank: every training case of ``(stage, world size, cases)``."""
    return trained("zero", Zero, case[2])


def traffic(Zero, case) -> list[dict]:
    """Inside a rank: the one training case of ``(stage, world size, case)``, its last step traced."""
    return trained("zero", Zero, [case[2]])


def _notebook_globals(Zero) -> dict:
    """The namespace ``Zero``'s methods look the lab's functions up in (the notebook's, in a rank)."""
    return getattr(getattr(Zero, "__init__", None), "__globals__", {})


@contextlib.contextmanager
def _bound(names: dict, functions: dict):
    """``names`` (a notebook's globals) bound to ``functions`` while the block runs."""
    saved = {name: names[name] for name in functions if name in names}
    names.update({name: fn for name, fn in functions.items() if name in saved})
    try:
        yield
    finally:
        names.update(saved)


def _measuring_temporaries(sharded_step, peaks: list):
    """``sharded_step`` that appends to ``peaks`` the most bytes of tensors it created that were alive
    at once (:class:`minidist.memory.CreatedBytes`), leaving out the optimizer's step and its own."""
    def measured(units, optimizer):
        step = optimizer.step

        def step_not_counted(*args, **kwargs):
            with CreatedBytes.paused():
                return step(*args, **kwargs)
        optimizer.step = step_not_counted
        try:
            with CreatedBytes() as meter:
                sharded_step(units, optimizer)
        finally:
            del optimizer.step
        peaks.append(meter.peak)
    return measured


def reference_live(case) -> int:
    """Inside a rank, before the student's code: the bytes the lab's reference (the given Zero on the
    library's stand-ins) holds throughout a step. (What it allocates once and keeps, the student's run
    then finds allocated: it can only count against the reference.)"""
    return train(student_trainer("zero", ReferenceZero, stage=case[0], optimizer="adam"), live=True,
                 **MEMORY_RUN)["live_bytes"]


def memory(Zero, case, reference: int | None = None) -> dict:
    """Inside a rank: the model states measured after forward, backward and the step; the bytes held
    through a step (where ``reference``, the lab's, was measured first); where ``sharded_step`` is
    graded, the most bytes of temporaries it held at once."""
    stage = case[0]
    mark(describe_memory(stage))
    make = student_trainer("zero", Zero, stage=stage, optimizer="adam")
    peaks: list = []
    names = _notebook_globals(Zero)
    graded_step = "sharded_step" in GRADED[stage] and "sharded_step" in names
    with _bound(names, {"sharded_step": _measuring_temporaries(names["sharded_step"], peaks)}) if graded_step \
            else contextlib.nullcontext():
        res = train(make, measure=True, live=reference is not None, **MEMORY_RUN)
    res["step_temporaries"] = peaks[-1] if peaks else None       # the last step's, the one measured
    res["reference_live"] = reference
    return res

