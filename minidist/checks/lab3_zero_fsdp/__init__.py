"""Lab 3's checks (ZeRO / FSDP, Rajbhandari et al. 2019): ``reduce_scatter_gradients`` on one unit,
and the lab's ``Zero`` wrapper per stage.

Equality with single-process training, traced traffic (reduce-scatter + all-gather of Ψ: the
2(N−1)/N·Ψ of DDP for stages 1-2, 3(N−1)/N·Ψ for stage 3) and measured model-state memory
against the ZeRO formula (optimizer states 8Ψ/N, gradients 4Ψ/N from stage 2, parameters 4Ψ/N
at stage 3), with the bytes held through a step next to the given ``Zero`` on the library's functions.
Training goes through the one data-parallel loop (:mod:`minidist.checks.kit.training`). A lab test cell
is a one-liner::

    checks.check_zero(Zero, stage=1)
    checks.check_device(Zero, stage=3)          # no tensor made off the parameters' device

Each stage's checks grade the functions that stage adds (ZeRO-1 ``sharded_step``, ZeRO-2
``reduce_scatter_gradients``, ZeRO-3 ``gather_parameters`` and ``free_parameters``): one Check per
stage, chosen by ``stage``; minidist's own ZeRO stands in for the others that stage calls
(``cases.CALLED``) inside the ranks, through thin adapters (``stand_ins.py``; the notebook's
given classes, on them, are ``given.py``). The cases are in ``cases.py``, the code that runs the
student's in ``answers.py``, the comparisons in ``verdicts.py``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import Registry
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.lab3_zero_fsdp import answers, cases, verdicts
from minidist.checks.lab3_zero_fsdp.stand_ins import BY_NAME

#: minidist's ZeRO/FSDP (and the rest of minidist.data_parallel), the stand-ins over it and the given
#: classes on them are refused in graded code; the lab hands out FlatShard.
REFUSED = Refusal("ZeRO and FSDP", ("minidist.data_parallel", "minidist.checks.lab3_zero_fsdp.stand_ins",
                                    "minidist.checks.lab3_zero_fsdp.given"),
                  allow=("minidist.data_parallel.common.FlatShard",), checks=__name__)
CHECKS = Registry(__name__)


def stood_in(stage: int) -> dict:
    """The library's stand-in for every function the given Zero calls at stage ``stage`` that its checks
    do not grade."""
    return {name: BY_NAME[name] for name in cases.STAND_INS[stage]}


def refusal(stage: int) -> Refusal:
    """REFUSED, with the stand-ins of this stage allowed (the graded functions' own stay refused)."""
    allow = tuple(f"{fn.__module__}.{name}" for name, fn in stood_in(stage).items())
    return Refusal(REFUSED.technique, REFUSED.modules, REFUSED.allow + allow, REFUSED.checks)


def _stage(stage: int) -> dict:
    """What every check of one stage shares: its ranks, its refusal, its stand-ins."""
    return dict(where="launch", world=lambda case: case[1], refusal=refusal(stage),
                stand_ins=lambda params: stood_in(stage))


def _memory_launch(case) -> dict:
    """The memory check's launch: tensors allocated as the code runs (no private copies until wait());
    at N = 2 the given Zero on the library's stand-ins is measured first on the same rank, and the launch
    trains twice."""
    if case[1] != cases.LIVE_WORLD:
        return dict(outputs_at_wait=False)
    return dict(outputs_at_wait=False, reference=answers.reference_live, timeout_factor=2)


REDUCE_SCATTER = CHECKS.check("reduce_scatter_gradients", cases.unit_cases, answers.unit, verdicts.unit,
                              covered=cases.unit_covered, where="launch", world=lambda case: case[0], refusal=REFUSED)
ZERO = {s: CHECKS.check(f"Zero(stage={s})", partial(cases.zero_cases, s), answers.zero, verdicts.zero,
                        covered=partial(cases.zero_covered, s), **_stage(s)) for s in cases.GRADED}
MEMORY = {s: CHECKS.check(f"Zero(stage={s}) memory", partial(cases.memory_cases, s), answers.memory, verdicts.memory,
                          params=("slack",), covered=partial(cases.memory_covered, s), launch=_memory_launch,
                          **_stage(s)) for s in cases.GRADED}
TRAFFIC = {s: CHECKS.check(f"Zero(stage={s}) traffic", partial(cases.traffic_cases, s), answers.traffic,
                           verdicts.traffic, params=(), covered=partial(cases.traffic_covered, s), **_stage(s))
           for s in cases.GRADED}
DEVICE = {s: on_meta(ZERO[s]) for s in cases.GRADED}


@CHECKS.entry(REDUCE_SCATTER)
def check_reduce_scatter_gradients(reduce_scatter_gradients, ShardedUnit, hidden: bool = False,
                                   timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """On each rank, ``unit.shard.grad`` becomes (accumulates) the average over ranks of this
    rank's shard of the flat, padded gradient (a missing gradient counts as zeros); every
    full ``p.grad`` is dropped; one reduce_scatter_tensor of the padded flat gradient per call."""


@CHECKS.entry(ZERO, by="stage")
def check_zero(Zero, stage: int, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """ZeRO stage ``stage`` trains exactly like one process on the whole batch (Adam, and SGD
    with momentum to catch a wrong gradient scale)."""


@CHECKS.entry(MEMORY, by="stage")
def check_zero_memory(Zero, stage: int, timeout: float = TRAINING_CHECK_TIMEOUT, slack: float = 0.05) -> None:
    """Measured model-state bytes per rank (live storages, minidist.memory) within ``slack``
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
def check_zero_traffic(Zero, stage: int, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Stages 1-2: reduce-scatter + all-gather of Ψ, no all-reduce, the same wire volume as
    DDP (2(N−1)/N·Ψ); stage 3: two all-gathers (forward, backward) and one reduce-scatter,
    3(N−1)/N·Ψ, 1.5x DDP."""


@CHECKS.entry(DEVICE, by="stage")
def check_device(Zero, stage: int, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Where the tensors of the functions stage ``stage`` grades live: its first visible training run
    with torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made without
    ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
