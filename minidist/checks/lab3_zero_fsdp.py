"""Lab 3's checks (ZeRO / FSDP, Rajbhandari et al. 2019): the lab's Zero wrapper per stage,
and (from :mod:`minidist.checks.lab3_reduce_scatter`) reduce_scatter_gradients on one unit.

Equality with single-process training, traced traffic (reduce-scatter + all-gather of Ψ: the
2(N−1)/N·Ψ of DDP for stages 1-2, 3(N−1)/N·Ψ for stage 3) and measured model-state memory
against the ZeRO formula (optimizer states 8Ψ/N, gradients 4Ψ/N from stage 2, parameters 4Ψ/N
at stage 3). Training goes through the one data-parallel loop (:mod:`minidist.checks.kit.training`).
A lab test cell is a one-liner::

    checks.check_zero(Zero, stage=1)

Each stage's checks grade the functions that stage adds (ZeRO-1 ``sharded_step``, ZeRO-2
``reduce_scatter_gradients``, ZeRO-3 ``gather_parameters`` and ``free_parameters``); the lab's
reference stands in for the others (:mod:`minidist.checks.lab3_grading`).
"""
from __future__ import annotations

import contextlib

from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT, launch_named, mark_case, report_passed
from minidist.checks.kit.docket import Judged, from_raising, judged
from minidist.checks.lab3_grading import (GRADED, REFUSED, WithStandIns, bound, graded,  # noqa: F401
                                          notebook_globals, refusal)
from minidist.checks.lab3_reduce_scatter import check_reduce_scatter_gradients  # noqa: F401  (the lab's test cells)
from minidist.checks.lab3_reference import REFERENCES
from minidist.checks.kit.training import check_equal, student_trainer, train_student
from minidist.checks.kit.quiet import passes_quietly
from minidist.cost import ring_wire_bytes, zero_memory_bytes_fp32
from minidist.harness.data_parallel import train
from minidist.memory import CreatedBytes
from minidist.models import TINY_MLP_VARIANTS, describe_mlp

MEMORY_MODEL = {"hidden": 32, "n_hidden": 8}     # Ψ ≈ 8.8 k in 10 units: padding and Adam's step counters < 1%


def _zero_runs(stage: int, hidden: bool) -> list[tuple]:
    models = ["frozen", "unused"] if hidden else ["plain", "unused"]
    cases = [dict(stage=stage, model_kwargs=TINY_MLP_VARIANTS[m], steps=3, batch=24, optimizer=o)
             for m in models for o in ("adam", "sgd")]
    return [(stage, n, cases) for n in ((3, 4) if hidden else (2,))]


def _zero_equal(run, out) -> None:
    stage, n, cases = run
    check_equal(graded(stage), n, cases, out, diagnose=False)


# Judged (minidist.checks.kit.docket): the child files every rank's results; the grader's judge compares again.
JUDGED_ZERO = Judged(__name__, "Zero", _zero_runs, from_raising(_zero_equal), params=("stage", "hidden"))


@judged(JUDGED_ZERO)
@passes_quietly
def check_zero(Zero, stage: int, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """ZeRO stage ``stage`` trains exactly like one process on the whole batch (Adam, and SGD
    with momentum to catch a wrong gradient scale)."""
    runs = _zero_runs(stage, hidden)
    JUDGED_ZERO.run(dict(stage=stage, hidden=hidden), lambda run: train_student(
        "zero", WithStandIns(Zero, stage), run[1], run[2], graded(stage), timeout, refusal(stage)))
    report_passed(f"Zero(stage={stage})", f"N={', '.join(str(n) for _, n, _ in runs)}, {len(runs[0][2])} models × "
                                         f"Adam/SGD: parameters vs one process on the whole batch", hidden)


_MEMORY_RUN = dict(model_kwargs=MEMORY_MODEL, steps=2, batch=24)     # measured: the second step


def _reference_live(progress, Zero, stage):
    """Inside a rank, before the student's code: what the lab's reference Zero holds throughout a step.
    (What it allocates once and keeps, the student's run then finds allocated: it can only count
    against the reference.)"""
    mark_case(progress, f"the lab's reference, stage {stage}")
    with bound(Zero, REFERENCES):
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
    make = student_trainer("zero", WithStandIns(Zero, stage), stage=stage, optimizer="adam")
    peaks: list = []
    names = notebook_globals(Zero)
    graded_step = "sharded_step" in GRADED[stage] and "sharded_step" in names
    with bound(Zero, {"sharded_step": _measuring_temporaries(names["sharded_step"], peaks)}) if graded_step \
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


def _zero_memory(run, out) -> None:
    stage, n, slack = run
    live = n == 2
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
                    f"{graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}: {label} hold {got} bytes; "
                    f"the formula says {want:.0f} (1/{n} of {full}), measured from live storages. "
                    + {"optimizer": "Is the optimizer built over the shards only?",
                       "grads": "Full gradients must be dropped (p.grad = None) once reduce-scattered.",
                       "params": "Gathered parameters must be freed (storage resized to 0) after use: after "
                                 "each unit's forward, and again after its backward."}[key])
        psi_bytes = 4 * res["numel"]
        temporaries = res["step_temporaries"]
        if temporaries is not None and temporaries > psi_bytes / n + STEP_SLACK * psi_bytes:
            raise AssertionError(
                f"{graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}: sharded_step created "
                f"{temporaries} bytes of tensors that were alive at once ({temporaries / psi_bytes:.2f}× the "
                f"parameters' {psi_bytes} bytes), outside optimizer.step(); at most a copy of this rank's "
                f"shards (1/{n}) + {STEP_SLACK}× is allowed. All-gather unit by unit straight into unit.flat: "
                f"one buffer for every unit's parameters (a coalesced all-gather), or a full-size buffer per "
                f"unit kept to the end, is a second full copy of the model, the memory ZeRO removes.")
        extra = res["live_bytes"] - ref if live else 0
        if extra > LIVE_SLACK * psi_bytes:
            raise AssertionError(
                f"{graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}: throughout a training step "
                f"(forward, backward, optimizer step) the rank holds {extra} bytes more than the lab's reference "
                f"({extra / psi_bytes:.2f}× the parameters' {psi_bytes} bytes; at most {LIVE_SLACK}× is allowed), "
                f"counting every live tensor on the rank's device. Something model-sized is kept from one step to the next: a "
                f"buffer of full size per unit (of gradients or parameters, kept for reuse) is the unsharded "
                f"copy ZeRO removes.")


JUDGED_MEMORY = Judged(__name__, "Zero memory", lambda stage, slack: [(stage, n, slack) for n in (2, 4)],
                       from_raising(_zero_memory), params=("stage", "slack"))


@judged(JUDGED_MEMORY)
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
    JUDGED_MEMORY.run(dict(stage=stage, slack=slack), lambda run: launch_named(
        _memory_body, run[1], Zero, stage, name=graded(stage) + ", memory",
        timeout=2 * timeout if run[1] == 2 else timeout, refuse=refusal(stage), outputs_at_wait=False,
        reference=_reference_live if run[1] == 2 else None))
    report_passed(f"Zero(stage={stage}) memory", "N=2, 4: model states vs the ZeRO formula"
                  + (", the step's temporaries" if "sharded_step" in GRADED[stage] else "")
                  + ", bytes held through a step vs the lab's reference")


def _traffic_runs(stage: int) -> list[tuple]:
    return [(stage, n, dict(stage=stage, model_kwargs=MEMORY_MODEL, steps=2, batch=24, optimizer="adam"))
            for n in (2, 3)]


def _zero_traffic(run, out) -> None:
    stage, n, case = run
    for r in range(n):
        res = out[r][0]
        psi = 4 * res["numel"]
        traced: dict = {}
        for op, b in res["events"]:
            # either all-gather fills the flat buffer: the tensor form, or the list form into its chunk
            # views (the tracer counts the input shard of both)
            op = "all_gather_into_tensor" if op == "all_gather" else op
            traced[op] = traced.get(op, 0) + b
        what = f"{graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}, one step"
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


JUDGED_TRAFFIC = Judged(__name__, "Zero traffic", _traffic_runs, from_raising(_zero_traffic), params=("stage",))


@judged(JUDGED_TRAFFIC)
@passes_quietly
def check_zero_traffic(Zero, stage: int, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Stages 1-2: reduce-scatter + all-gather of Ψ, no all-reduce, the same wire volume as
    DDP (2(N−1)/N·Ψ); stage 3: two all-gathers (forward, backward) and one reduce-scatter,
    3(N−1)/N·Ψ, 1.5x DDP."""
    JUDGED_TRAFFIC.run(dict(stage=stage), lambda run: train_student(
        "zero", WithStandIns(Zero, stage), run[1], [run[2]], graded(stage) + ", traffic", timeout, refusal(stage)))
    report_passed(f"Zero(stage={stage}) traffic", f"N=2, 3: reduce-scatter + all-gather{' ×2' if stage == 3 else ''}, "
                                                 f"{3 if stage == 3 else 2}(N−1)/N·Ψ·4 wire bytes")
