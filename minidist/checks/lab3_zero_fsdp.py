"""Lab 3's checks (ZeRO / FSDP): reduce_scatter_gradients, and the lab's Zero wrapper per stage.

Equality with single-process training, traced traffic (reduce-scatter + all-gather, 1.5x
DDP for stage 3) and measured model-state memory against the ZeRO formula. Training goes
through the one data-parallel loop (:mod:`minidist.checks.training`). A lab test cell is a
one-liner::

    checks.check_zero(Zero, stage=1)

Points follow the work: each stage's end-to-end checks grade the student's functions that
stage adds (:data:`GRADED`): ZeRO-1 ``sharded_step``, ZeRO-2 ``reduce_scatter_gradients``
(called from backward hooks, full gradients dropped), ZeRO-3 ``gather_parameters`` and
``free_parameters``. The lab's other functions are stood in for by the lab's reference
(:mod:`minidist.checks.lab3_reference`) inside the ranks, so a wrong function loses the
points of the tests that grade it, and every failure names the function it grades.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.checks.common import TRAINING_CHECK_TIMEOUT, Refusal, launch_named, mark_case, report_passed
from minidist.checks.lab3_reference import REFERENCES
from minidist.checks.training import check_equal, student_trainer, train_student
from minidist.checks.quiet import passes_quietly
from minidist.cost import ring_wire_bytes, zero_memory_bytes_fp32
from minidist.harness.data_parallel import train
from minidist.memory import CreatedBytes
from minidist.models import TINY_MLP_VARIANTS, describe_mlp
from minidist.runtime import device
from minidist.trace import trace

# The lab's wrapper class ``Zero(model, stage, optimizer="adam", lr=1e-2)`` (given in the
# notebook, built on the student's functions) has: ``__call__(x)``, ``finish_backward()``
# (after loss.backward()), ``step()``, ``zero_grad()``, ``state_tensors()`` (every
# parameter-like tensor held), ``optimizer`` and ``full_parameters()`` (flat fp32 vector).
#: minidist's ZeRO/FSDP (and the rest of minidist.data_parallel) is refused in graded code; the lab
#: hands out FlatShard.
REFUSED = Refusal("ZeRO and FSDP", ("minidist.data_parallel", "minidist.checks.lab3_reference"),
                  allow=("minidist.data_parallel.common.FlatShard",), checks=__name__)
GRADED = {1: ("sharded_step",), 2: ("reduce_scatter_gradients",), 3: ("gather_parameters", "free_parameters")}


def _stand_ins(stage: int) -> dict:
    """The lab's reference for every student function that stage ``stage``'s tests do not grade."""
    return {name: fn for name, fn in REFERENCES.items() if name not in GRADED[stage]}


def _refusal(stage: int) -> Refusal | None:
    """REFUSED, with the stand-ins of this stage allowed (the graded functions' own references stay refused)."""
    if REFUSED is None:
        return None
    allow = tuple(f"{fn.__module__}.{name}" for name, fn in _stand_ins(stage).items())
    return Refusal(REFUSED.technique, REFUSED.modules, REFUSED.allow + allow, REFUSED.checks)


def _notebook_globals(Zero) -> dict:
    """The namespace ``Zero``'s methods look the lab's functions up in (the notebook's, in a rank)."""
    return getattr(getattr(Zero, "__init__", None), "__globals__", {})


class _WithStandIns:
    """``Zero`` whose calls of the lab's functions not graded at ``stage`` go to the reference:
    the notebook's globals are rebound inside the rank (a copy of the notebook), never here."""

    def __init__(self, Zero, stage: int):
        self.Zero, self.stage = Zero, stage

    def __call__(self, model, stage, **kwargs):
        names = _notebook_globals(self.Zero)
        for name, fn in _stand_ins(self.stage).items():
            if name in names:
                names[name] = fn
        return self.Zero(model, stage, **kwargs)


def _graded(stage: int) -> str:
    others = [n for n in _stand_ins(stage)]
    return (f"Zero(stage={stage}), grading your {' and '.join(GRADED[stage])} "
            f"(the lab's reference stands in for {', '.join(others)})")
MEMORY_MODEL = {"hidden": 32, "n_hidden": 8}     # Ψ ≈ 8.8 k in 10 units: padding and Adam's step counters < 1%


@passes_quietly
def check_zero(Zero, stage: int, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """ZeRO stage ``stage`` trains exactly like one process on the whole batch (Adam, and SGD
    with momentum to catch a wrong gradient scale)."""
    sizes = (3, 4) if hidden else (2,)
    models = ["frozen", "unused"] if hidden else ["plain", "unused"]
    for n in sizes:
        cases = [dict(stage=stage, model_kwargs=TINY_MLP_VARIANTS[m], steps=3, batch=24, optimizer=o)
                 for m in models for o in ("adam", "sgd")]
        out = train_student("zero", _WithStandIns(Zero, stage), n, cases, _graded(stage), timeout, _refusal(stage))
        check_equal(_graded(stage), n, cases, out, diagnose=False)
    report_passed(f"Zero(stage={stage})", f"N={', '.join(map(str, sizes))}, {len(cases)} models × Adam/SGD: parameters "
                                         f"vs one process on the whole batch", hidden)


@contextlib.contextmanager
def _bound(Zero, functions: dict):
    """The notebook's globals that ``Zero``'s methods call, bound to ``functions`` while the block runs."""
    names = _notebook_globals(Zero)
    saved = {name: names[name] for name in functions if name in names}
    names.update({name: fn for name, fn in functions.items() if name in saved})
    try:
        yield
    finally:
        names.update(saved)


_MEMORY_RUN = dict(model_kwargs=MEMORY_MODEL, steps=2, batch=24)     # measured: the second step


def _reference_live(progress, Zero, stage):
    """Inside a rank, before the student's code: what the lab's reference Zero holds throughout a step.
    (What it allocates once and keeps, the student's run then finds allocated: it can only count
    against the reference.)"""
    mark_case(progress, f"the lab's reference, stage {stage}")
    with _bound(Zero, REFERENCES):
        return train(student_trainer("zero", Zero, stage=stage, optimizer="adam"), live=True,
                     **_MEMORY_RUN)["live_bytes"]


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


def _memory_body(progress, Zero, stage, reference=None):
    mark_case(progress, f"stage {stage}, {describe_mlp(MEMORY_MODEL)}, memory")
    make = student_trainer("zero", _WithStandIns(Zero, stage), stage=stage, optimizer="adam")
    peaks: list = []
    names = _notebook_globals(Zero)
    graded_step = "sharded_step" in GRADED[stage] and "sharded_step" in names
    with _bound(Zero, {"sharded_step": _measuring_temporaries(names["sharded_step"], peaks)}) if graded_step \
            else contextlib.nullcontext():
        res = train(make, measure=True, live=reference is not None, **_MEMORY_RUN)
    res["step_temporaries"] = peaks[-1] if peaks else None       # the last step's, the one measured
    return reference, res


#: How many bytes more than the lab's reference a rank may hold throughout a training step, as a fraction
#: of the fp32 parameters' 4Ψ. Measured on MEMORY_MODEL with both cores busy, 5 runs each: the solution and
#: the bank's correct variants within 0.12 (a unit's buffers that gloo's thread frees late), a full-size
#: gradient buffer kept per unit 0.94 to 1.06.
LIVE_SLACK = 0.5

#: How many bytes of temporaries ``sharded_step`` may create and hold at once, beyond a copy of this rank's
#: shards (the all-gathers' inputs), as a fraction of the fp32 parameters' 4Ψ. Deterministic (no backend
#: buffer counts): on MEMORY_MODEL at N = 2 / 4 the solution holds 0.12 / 0.06, a fresh full-size buffer
#: per unit 0.30 / 0.27, every unit's all-gather in flight at once 0.50 / 0.25 (all of it shard copies);
#: one coalesced buffer for every unit 1.62 / 1.37, a full-size buffer per unit all kept to the end 1.50 / 1.25.
STEP_SLACK = 0.5


@passes_quietly
def check_zero_memory(Zero, stage: int, timeout: float = TRAINING_CHECK_TIMEOUT, slack: float = 0.05) -> None:
    """Measured model-state bytes per rank (live storages, minidist.memory) within ``slack``
    of the fp32 ZeRO formula (minidist.cost) for N = 2 and 4: optimizer states 8Ψ/N (stages
    1-3), gradients 4Ψ/N after backward (stages 2-3), parameters 4Ψ/N between forward and
    backward and after the step (stage 3). An implementation that keeps the unsharded copy
    is off by a factor of up to N.

    Then, for N = 2, every byte of tensors on its device the rank holds throughout a training step,
    whoever holds it (:class:`minidist.memory.LiveBytes`), next to the lab's reference in the
    same process: at most half the parameters' bytes more, so nothing model-sized is kept from
    one step to the next (such as a gradient buffer per unit, which no state tensor shows).
    That launch trains twice, with the profiler on: it has twice the timeout.

    Where ``sharded_step`` is graded (stage 1), also the temporaries it creates during the
    step, outside ``optimizer.step()`` (:class:`minidist.memory.CreatedBytes`): at most a copy
    of this rank's shards plus ``STEP_SLACK`` of the parameters' bytes alive at once, so the
    all-gathers rebuild the parameters unit by unit, never through a second copy of the model."""
    for n in (2, 4):
        live = n == 2
        out = launch_named(_memory_body, n, Zero, stage, name=_graded(stage) + ", memory",
                           timeout=2 * timeout if live else timeout, refuse=_refusal(stage), outputs_at_wait=False,
                           reference=_reference_live if live else None)
        for r in range(n):
            ref, res = out[r]
            formula = zero_memory_bytes_fp32(stage, res["numel"], n)
            checks = [("optimizer", "memory", "optimizer states (Adam's two moments)")]
            if stage >= 2:
                checks.append(("grads", "memory_after_backward", "gradients after backward"))
            if stage >= 3:
                checks.append(("params", "memory", "parameters after the step"))
                checks.append(("params", "memory_after_forward", "parameters between forward and backward"))
            for key, when, label in checks:
                got, want = res[when][key], formula[key]
                if got > (1 + slack) * want:
                    full = {"optimizer": 8, "grads": 4, "params": 4}[key] * res["numel"]
                    raise AssertionError(
                        f"{_graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}: {label} hold {got} bytes; "
                        f"the formula says {want:.0f} (1/{n} of {full}), measured from live storages. "
                        + {"optimizer": "Is the optimizer built over the shards only?",
                           "grads": "Full gradients must be dropped (p.grad = None) once reduce-scattered.",
                           "params": "Gathered parameters must be freed (storage resized to 0) after use: after "
                                     "each unit's forward, and again after its backward."}[key])
            psi_bytes = 4 * res["numel"]
            temporaries = res["step_temporaries"]
            if temporaries is not None and temporaries > psi_bytes / n + STEP_SLACK * psi_bytes:
                raise AssertionError(
                    f"{_graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}: sharded_step created "
                    f"{temporaries} bytes of tensors that were alive at once ({temporaries / psi_bytes:.2f}× the "
                    f"parameters' {psi_bytes} bytes), outside optimizer.step(); at most a copy of this rank's "
                    f"shards (1/{n}) + {STEP_SLACK}× is allowed. All-gather unit by unit straight into unit.flat: "
                    f"one buffer for every unit's parameters (a coalesced all-gather), or a full-size buffer per "
                    f"unit kept to the end, is a second full copy of the model, the memory ZeRO removes.")
            extra = res["live_bytes"] - ref if live else 0
            if extra > LIVE_SLACK * psi_bytes:
                raise AssertionError(
                    f"{_graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}: throughout a training step "
                    f"(forward, backward, optimizer step) the rank holds {extra} bytes more than the lab's reference "
                    f"({extra / psi_bytes:.2f}× the parameters' {psi_bytes} bytes; at most {LIVE_SLACK}× is allowed), "
                    f"counting every live tensor on the rank's device. Something model-sized is kept from one step to the next: a "
                    f"buffer of full size per unit (of gradients or parameters, kept for reuse) is the unsharded "
                    f"copy ZeRO removes.")
    report_passed(f"Zero(stage={stage}) memory", "N=2, 4: model states vs the ZeRO formula"
                  + (", the step's temporaries" if "sharded_step" in GRADED[stage] else "")
                  + ", bytes held through a step vs the lab's reference")


@passes_quietly
def check_zero_traffic(Zero, stage: int, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Stages 1-2: reduce-scatter + all-gather of Ψ, no all-reduce, the same wire volume as
    DDP (2(N−1)/N·Ψ); stage 3: two all-gathers (forward, backward) and one reduce-scatter,
    3(N−1)/N·Ψ, 1.5x DDP."""
    for n in (2, 3):
        case = dict(stage=stage, model_kwargs=MEMORY_MODEL, steps=2, batch=24, optimizer="adam")
        out = train_student("zero", _WithStandIns(Zero, stage), n, [case], _graded(stage) + ", traffic", timeout,
                            _refusal(stage))
        for r in range(n):
            res = out[r][0]
            psi = 4 * res["numel"]
            traced: dict = {}
            for op, b in res["events"]:
                # either all-gather fills the flat buffer: the tensor form, or the list form into its chunk
                # views (the tracer counts the input shard of both)
                op = "all_gather_into_tensor" if op == "all_gather" else op
                traced[op] = traced.get(op, 0) + b
            what = f"{_graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}, one step"
            if set(traced) != {"reduce_scatter_tensor", "all_gather_into_tensor"}:
                raise AssertionError(f"{what}: expected only reduce_scatter_tensor and all-gathers "
                                     f"(all_gather_into_tensor or all_gather), saw "
                                     f"{sorted({op for op, _ in res['events']}) or 'no communication'}")
            rs, ag = traced["reduce_scatter_tensor"], traced["all_gather_into_tensor"]
            gathers = 2 if stage == 3 else 1
            pad = 4 * 16 * n                     # at most N-1 padding elements per unit
            if not psi <= rs <= psi + pad:
                raise AssertionError(f"{what}: reduce-scattered {rs} bytes; expected the padded gradient, "
                                     f"Ψ·4 = {psi} (+ padding), once per step")
            if abs(ag * n - gathers * rs) > 0:
                raise AssertionError(f"{what}: all-gathered {ag} bytes of shards (= {ag * n} bytes of parameters); "
                                     f"expected {gathers}× the parameters ({gathers * rs} bytes)"
                                     + (": once before forward and once before backward" if stage == 3 else
                                        ": once, after the sharded optimizer step"))
            wire = sum(ring_wire_bytes(op, b, n) for op, b in traced.items())
            factor = 3 if stage == 3 else 2
            if abs(wire / psi - factor * (n - 1) / n) > 0.05:
                raise AssertionError(f"{what}: {wire:.0f} wire bytes; expected {factor}(N−1)/N·Ψ·4")
    report_passed(f"Zero(stage={stage}) traffic", f"N=2, 3: reduce-scatter + all-gather{' ×2' if stage == 3 else ''}, "
                                                 f"{3 if stage == 3 else 2}(N−1)/N·Ψ·4 wire bytes")


def _local_grad(shape, rank, k, micro, dtype=torch.float32):
    """Rank ``rank``'s gradient of parameter ``k`` in micro-batch ``micro``, on the CPU: distinct everywhere."""
    g = torch.Generator(device="cpu").manual_seed(1000 * micro + 100 * rank + k)
    return torch.randn(shape, generator=g, dtype=dtype, device="cpu")


def _unit_body(progress, cases, reduce_scatter_gradients, ShardedUnit):
    """Give one module non-zero parameters and known, per-rank and per-micro-batch gradients
    (one of them missing), reduce-scatter twice, return the shard grad and what else changed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = device()          # the rank's device; the check compares on the CPU
    out = []
    for shapes, missing, dtype in cases:
        mark_case(progress, f"a unit of parameters {shapes} in {dtype}, parameter {missing} without a gradient")
        module = nn.Module()
        for k, s in enumerate(shapes):
            g = torch.Generator(device="cpu").manual_seed(k)
            module.register_parameter(f"p{k}", nn.Parameter(torch.randn(s, generator=g, dtype=dtype, device="cpu").to(dev)))
        unit = ShardedUnit(module, n, rank)
        before = [p.detach().clone() for p in unit.params]
        with trace() as t:
            for micro in range(2):              # two micro-batches: the second call must add
                for k, p in enumerate(unit.params):
                    p.grad = None if k == missing else _local_grad(p.shape, rank, k, micro, dtype).to(dev)
                reduce_scatter_gradients(unit)
        grads_left = [p.grad is not None for p in unit.params]
        shard_grad = None if unit.shard.grad is None else unit.shard.grad.clone()
        aliased = shard_grad is not None and (unit.shard.grad.untyped_storage().data_ptr()
                                              == unit.flat.untyped_storage().data_ptr())
        out.append({"shard_grad": shard_grad, "grads_left": grads_left, "aliased": aliased,
                    "params_kept": all(torch.equal(p.detach(), b) for p, b in zip(unit.params, before)),
                    "events": [(e.op, e.nbytes) for e in t.comm()], "padded": unit.layout.padded_numel,
                    "shard_numel": unit.layout.shard_numel})
    return out


@passes_quietly
def check_reduce_scatter_gradients(reduce_scatter_gradients, ShardedUnit, hidden: bool = False,
                                   timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """On each rank, ``unit.shard.grad`` becomes (accumulates) the average over ranks of this
    rank's shard of the flat, padded gradient (a missing gradient counts as zeros); every
    full ``p.grad`` is dropped; one reduce_scatter_tensor of the padded flat gradient per call."""
    sizes = (2, 3, 4) if hidden else (2,)
    f32, f64 = torch.float32, torch.float64
    # (shapes, index of the parameter without a gradient: last, in the middle, none, first; dtype)
    cases = [([(3, 5), (7,)], 1, f32), ([(4,), (2, 2), (5,)], 1, f32)] + (
        [([(1,)], None, f32), ([(6, 7), (6,), (9,)], 0, f32), ([(5, 3), (4,)], None, f64)] if hidden else [])
    for n in sizes:
        out = launch_named(_unit_body, n, cases, reduce_scatter_gradients, ShardedUnit,
                           name="reduce_scatter_gradients", timeout=timeout, refuse=REFUSED)
        for i, (shapes, missing, dtype) in enumerate(cases):
            what = (f"reduce_scatter_gradients (world_size={n}, parameters {shapes}"
                    + ("" if dtype == f32 else f" in {dtype}")
                    + (f", parameter {missing} without a gradient)" if missing is not None else ")"))
            flats = []
            for r in range(n):
                for micro in range(2):
                    flat = torch.cat([torch.zeros(s, dtype=dtype).reshape(-1) if k == missing else
                                      _local_grad(s, r, k, micro, dtype).reshape(-1) for k, s in enumerate(shapes)])
                    flats.append(torch.cat([flat, torch.zeros(out[0][i]["padded"] - flat.numel(), dtype=dtype)]))
            mean = 2 * torch.stack(flats).mean(0)          # the sum over the micro-batches of the rank mean
            S = out[0][i]["shard_numel"]
            for r in range(n):
                res = out[r][i]
                if res["shard_grad"] is None:
                    raise AssertionError(f"{what}: rank {r}: unit.shard.grad is None after the call")
                if not res["params_kept"]:
                    raise AssertionError(f"{what}: rank {r}: the parameters changed; reduce_scatter_gradients must "
                                         f"leave them (and unit.flat, unit.shard) untouched: write the reduce-scatter's "
                                         f"output into a new tensor")
                want = mean[r * S:(r + 1) * S]
                if res["shard_grad"].dtype != dtype:
                    raise AssertionError(f"{what}: rank {r}: unit.shard.grad is {res['shard_grad'].dtype}; the "
                                         f"parameters are {dtype}: make buffers like the shard (torch.empty_like, "
                                         f"like=unit.shard), not in the default dtype")
                if res["shard_grad"].shape != want.shape or not torch.allclose(res["shard_grad"], want, atol=1e-5):
                    hint = ""
                    if res["shard_grad"].shape == want.shape:
                        if torch.allclose(res["shard_grad"], n * want, atol=1e-5):
                            hint = " It is N times too large: divide the sum by the world size."
                        elif missing is not None and missing < len(shapes) - 1:
                            hint = (f" Parameter {missing} has no gradient: it must count as zeros AT ITS PLACE "
                                    f"in the flat vector (unit.layout.flatten(..., like=unit.shard) does that).")
                        elif torch.allclose(res["shard_grad"], torch.stack(flats[1::2]).mean(0)[r * S:(r + 1) * S],
                                            atol=1e-5):
                            hint = (" It holds the second micro-batch's average only: a second call must ADD to "
                                    "unit.shard.grad (gradient accumulation), not replace it.")
                    raise AssertionError(f"{what}: rank {r}: after two calls (two micro-batches with different "
                                         f"gradients) unit.shard.grad should be the sum over both of the average over "
                                         f"ranks of shard {r} of the flat padded gradient.{hint}")
                if res["aliased"]:
                    raise AssertionError(f"{what}: rank {r}: unit.shard.grad shares memory with the parameters "
                                         f"(unit.flat): the next call overwrites the parameters")
                if any(res["grads_left"]):
                    raise AssertionError(f"{what}: rank {r}: p.grad is still set after the reduce-scatter; set it to "
                                         f"None so that the full gradient's memory is released")
                ops = [op for op, _ in res["events"]]
                if ops != ["reduce_scatter_tensor"] * 2:
                    raise AssertionError(f"{what}: rank {r}: expected one reduce_scatter_tensor per call, saw {ops}")
                nbytes = res["padded"] * want.element_size()
                if any(b != nbytes for _, b in res["events"]):
                    raise AssertionError(f"{what}: rank {r}: each reduce-scatter should take the whole padded flat "
                                         f"gradient ({nbytes} bytes), saw {[b for _, b in res['events']]}")
    report_passed("reduce_scatter_gradients", f"N={', '.join(map(str, sizes))}, {len(cases)} units"
                  + (" in fp32/fp64" if hidden else "") + ": the accumulated shard gradient, parameters unchanged, "
                  "one reduce-scatter per call", hidden)
