"""Lab 3's checks (ZeRO / FSDP, Rajbhandari et al. 2019): ``reduce_scatter_gradients`` on one unit,
and the lab's ``Zero`` wrapper per stage.

Equality with single-process training, traced traffic (reduce-scatter + all-gather of Ψ: the
2(N−1)/N·Ψ of DDP for stages 1-2, 3(N−1)/N·Ψ for stage 3) and measured model-state memory
against the ZeRO formula (optimizer states 8Ψ/N, gradients 4Ψ/N from stage 2, parameters 4Ψ/N
at stage 3), with the bytes held through a step next to the given ``Zero`` on the library's functions.
Training goes through the one data-parallel loop (:mod:`minidist.checks.kit.training`). A lab test cell
is a one-liner::

    checks.check_zero(Zero, stage=1)
    checks.check_device(Zero)          # every stage: no tensor made off the parameters' device

Each stage's checks grade the functions that stage adds (ZeRO-1 ``sharded_step``, ZeRO-2
``reduce_scatter_gradients``, ZeRO-3 ``gather_parameters`` and ``free_parameters``): one Check per
stage, chosen by ``stage``; minidist's own ZeRO stands in for the others that stage calls
(``cases.CALLED``) inside the ranks, through thin adapters (``stand_ins.py``; the notebook's
given classes, on them, are ``given.py``: ``reduce_scatter_gradients`` is graded on its ``ShardedUnit``). The cases are in ``cases.py``, the code that runs the
student's in ``answers.py``, the comparisons in ``verdicts.py``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.kit.stand_ins import StandIns
from minidist.checks.lab3_zero_fsdp import answers, cases, verdicts
from minidist.checks.lab3_zero_fsdp.stand_ins import BY_NAME as LIBRARY

#: minidist's ZeRO/FSDP (and the rest of minidist.data_parallel), the stand-ins over it and the given
#: classes on them are refused in graded code; the lab hands out FlatShard (and its given ShardedUnit).
REFUSED = Refusal("ZeRO and FSDP", ("minidist.data_parallel", "minidist.checks.lab3_zero_fsdp.stand_ins",
                                    "minidist.checks.lab3_zero_fsdp.given"),
                  allow=("minidist.data_parallel.common.FlatShard",), checks=__name__)
#: per stage, the library's stand-in for every function the given Zero calls that the stage does not grade
STAND_INS = StandIns({name: (fn, (f"{fn.__module__}.{name}",)) for name, fn in LIBRARY.items()}, calls=cases.STAND_INS)
CHECKS = Registry(__name__, refusal=REFUSED)


def _stage(stage: int) -> dict:
    """What every check of one stage shares: its ranks, its refusal, its stand-ins, its name in messages."""
    return dict(where="launch", world=lambda case: case[1], refusal=STAND_INS.refusal(REFUSED, stage),
                stand_ins=STAND_INS.rebound(stage), function="Zero")


def _memory_launch(case) -> dict:
    """The memory check's launch: tensors allocated as the code runs (no private copies until wait());
    at N = 2 the given Zero on the library's stand-ins is measured first on the same rank, and the launch
    trains twice."""
    if case[1] != cases.LIVE_WORLD:
        return dict(outputs_at_wait=False)
    return dict(outputs_at_wait=False, reference=answers.reference_live, timeout_factor=2)


#: the test cells that run each stage's checks (test_zero2 runs all three of stage 2)
EQUAL = {1: "zero1_equal", 2: "zero2", 3: "zero3_equal"}
COSTS = {1: "zero1_traffic_memory", 2: "zero2", 3: "zero3_traffic_memory"}

REDUCE_SCATTER = CHECKS.check("reduce_scatter_gradients", cases.unit_cases, answers.unit, verdicts.unit,
                              covered=cases.unit_covered, where="launch", world=lambda case: case[0],
                              refusal=REFUSED.allowing("minidist.checks.lab3_zero_fsdp.given.ShardedUnit"))
ZERO = {s: CHECKS.check(EQUAL[s], partial(cases.zero_cases, s), answers.zero, verdicts.zero, title=f"Zero(stage={s})",
                        covered=partial(cases.zero_covered, s), **_stage(s)) for s in cases.GRADED}
MEMORY = {s: CHECKS.check(f"{COSTS[s]} memory", partial(cases.memory_cases, s), answers.memory, verdicts.memory,
                          params=(), title=f"Zero(stage={s}) memory", covered=partial(cases.memory_covered, s),
                          launch=_memory_launch, **_stage(s)) for s in cases.GRADED}
TRAFFIC = {s: CHECKS.check(f"{COSTS[s]} traffic", partial(cases.traffic_cases, s), answers.traffic,
                           verdicts.traffic, params=(), title=f"Zero(stage={s}) traffic",
                           covered=partial(cases.traffic_covered, s), **_stage(s)) for s in cases.GRADED}
DEVICE = CHECKS.devices(*ZERO.values())


@CHECKS.entry(REDUCE_SCATTER)
def check_reduce_scatter_gradients(fn, *, hidden: bool = False) -> None:
    """On each rank, ``unit.shard.grad`` becomes (accumulates) the average over ranks of this
    rank's shard of the flat, padded gradient (a missing gradient counts as zeros); every
    full ``p.grad`` is dropped; one reduce_scatter_tensor of the padded flat gradient per call.
    The units are the lab's given ``ShardedUnit``."""


@CHECKS.entry(ZERO, by="stage")
def check_zero(fn, *, stage: int, hidden: bool = False) -> None:
    """ZeRO stage ``stage`` trains exactly like one process on the whole batch (Adam, and SGD
    with momentum to catch a wrong gradient scale)."""


@CHECKS.entry(MEMORY, by="stage")
def check_zero_memory(fn, *, stage: int) -> None:
    """Measured model-state bytes per rank (live storages, minidist.memory) within 5 %
    of the fp32 ZeRO formula (minidist.cost) for N = 2 and 4: optimizer states 8Ψ/N (stages
    1-3), gradients 4Ψ/N after backward (stages 2-3), parameters 4Ψ/N between forward and
    backward and after the step (stage 3). An implementation that keeps the unsharded copy
    is off by a factor of up to N.

    Then, for N = 2, every byte of tensors on its device the rank holds throughout a training step,
    whoever holds it (:class:`minidist.memory.LiveBytes`), next to the lab's reference measured
    before it on the same rank: at most half the parameters' bytes more, so nothing model-sized is
    kept from one step to the next (such as a gradient buffer per unit, which no state tensor shows).
    That launch trains twice, with the profiler on: it has twice the timeout.

    Where ``sharded_step`` is graded (stage 1), also the temporaries it creates during the
    step, outside ``optimizer.step()`` (:class:`minidist.memory.CreatedBytes`): at most a copy
    of this rank's shards plus ``STEP_SLACK`` of the parameters' bytes alive at once, so the
    all-gathers rebuild the parameters unit by unit, never through a second copy of the model."""


@CHECKS.entry(TRAFFIC, by="stage")
def check_zero_traffic(fn, *, stage: int) -> None:
    """Stages 1-2: reduce-scatter + all-gather of Ψ, no all-reduce, the same wire volume as
    DDP (2(N−1)/N·Ψ); stage 3: two all-gathers (forward, backward) and one reduce-scatter,
    3(N−1)/N·Ψ, 1.5x DDP."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``Zero`` live, at every stage: its first visible training run with torch's
    default device ``meta`` in every rank (kit/device_check.py). A tensor made without ``device=``
    fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
