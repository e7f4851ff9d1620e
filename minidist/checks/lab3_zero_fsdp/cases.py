"""Lab 3's cases (ZeRO / FSDP): what each stage grades, the visible cases of every check (the hidden
ones are the grader's, in ``hidden.py``), the memory rules' constants, and what a passing test's ✓
line says it covered.

A training case is a dict for :mod:`minidist.checks.kit.training`; a launched check's case names its
world size: ``(world size, units)`` for ``reduce_scatter_gradients``, ``(stage, world size, ...)``
for the Zero checks (every case of a world size in one launch).
"""
from __future__ import annotations

import torch

from minidist.checks.kit.withheld import hidden_cases
from minidist.models import TINY_MLP_VARIANTS, describe_mlp

#: Each stage's checks grade the student's functions that stage adds; the lab's reference, minidist's own
#: ZeRO through thin adapters (stand_ins.py), stands in for the others the given Zero calls at that
#: stage (CALLED), so a wrong function costs the points of the tests that grade it. Only those: a stand-in is
#: allowed where it stands in, and one the stage never calls (ZeRO-3's sharded_step, whose all-gather is
#: gather_parameters' work) would only be there to be called by a graded function.
GRADED = {1: ("sharded_step",), 2: ("reduce_scatter_gradients",), 3: ("gather_parameters", "free_parameters")}
CALLED = {1: ("reduce_scatter_gradients", "sharded_step"), 2: ("reduce_scatter_gradients", "sharded_step"),
          3: ("reduce_scatter_gradients", "gather_parameters", "free_parameters")}
STAND_INS = {stage: tuple(name for name in CALLED[stage] if name not in graded) for stage, graded in GRADED.items()}


def graded(stage: int) -> str:
    """How a failure names a stage's check: what it grades, and what the reference stands in for."""
    return (f"Zero(stage={stage}), grading your {' and '.join(GRADED[stage])} "
            f"(the lab's reference stands in for {', '.join(STAND_INS[stage])})")


def _sizes(sizes) -> str:
    return ", ".join(map(str, sizes))


# ----------------------------------------------------------------------------- reduce_scatter_gradients
F32, F64 = torch.float32, torch.float64


def unit_cases(hidden: bool) -> list[tuple]:
    """(world size, its units): a unit is (shapes, index of the parameter without a gradient: last,
    in the middle, none, first; dtype)."""
    units = [([(3, 5), (7,)], 1, F32), ([(4,), (2, 2), (5,)], 1, F32)]
    if not hidden:
        return [(2, units)]
    h = hidden_cases(__package__, "reduce_scatter_gradients")
    return [(n, units + h.UNITS) for n in h.UNIT_WORLD_SIZES]


def param_seed(k: int) -> int:
    """The seed of parameter ``k``'s values (the same on every rank)."""
    return k


def grad_seed(rank: int, k: int, micro: int) -> int:
    """The seed of rank ``rank``'s gradient of parameter ``k`` in micro-batch ``micro``: distinct everywhere."""
    return 1000 * micro + 100 * rank + k


def unit_covered(hidden: bool) -> str:
    runs = unit_cases(hidden)
    dtypes = f" in {hidden_cases(__package__, 'reduce_scatter_gradients').UNITS_SHOWN}" if hidden else ""
    return (f"N={_sizes(n for n, _ in runs)}; {len(runs[0][1])} units" + dtypes
            + ": the accumulated shard gradient, parameters unchanged, one reduce-scatter per call")


# ----------------------------------------------------------------------------- Zero: equality
def _zero_models(stage: int, hidden: bool) -> list[str]:
    return hidden_cases(__package__, f"Zero(stage={stage})").ZERO_MODELS if hidden else ["plain", "unused"]


def zero_cases(stage: int, hidden: bool) -> list[tuple]:
    """(stage, world size, training cases): every model × Adam and SGD with momentum (a wrong gradient scale)."""
    cases = [dict(stage=stage, model_kwargs=TINY_MLP_VARIANTS[m], steps=3, batch=24, optimizer=o)
             for m in _zero_models(stage, hidden) for o in ("adam", "sgd")]
    sizes = hidden_cases(__package__, f"Zero(stage={stage})").ZERO_WORLD_SIZES if hidden else (2,)
    return [(stage, n, cases) for n in sizes]


def zero_covered(stage: int, hidden: bool) -> str:
    return (f"N={_sizes(n for _, n, _ in zero_cases(stage, hidden))}, models {', '.join(_zero_models(stage, hidden))} × "
            f"Adam/SGD: parameters vs one process on the whole batch")


# ----------------------------------------------------------------------------- Zero: memory and traffic
MEMORY_MODEL = {"hidden": 32, "n_hidden": 8}     # Ψ ≈ 8.8 k in 10 units: padding and Adam's step counters < 1%
MEMORY_RUN = dict(model_kwargs=MEMORY_MODEL, steps=2, batch=24)     # measured: the second step
#: the world size where the bytes held through a step are compared with the lab's reference
LIVE_WORLD = 2

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


#: How far above the ZeRO formula a rank's model states may be (padding, Adam's step counters).
FORMULA_SLACK = 0.05


def memory_cases(stage: int) -> list[tuple]:
    """(stage, world size, slack on the ZeRO formula)."""
    return [(stage, n, FORMULA_SLACK) for n in (2, 4)]


def describe_memory(stage: int) -> str:
    return f"stage {stage}, {describe_mlp(MEMORY_MODEL)}, memory"


def memory_covered(stage: int) -> str:
    return ("N=2, 4: model states vs the ZeRO formula" + (", the step's temporaries" if "sharded_step" in GRADED[stage]
                                                           else "")
            + f", bytes held through a step vs the lab's reference (N={LIVE_WORLD})")


def traffic_cases(stage: int) -> list[tuple]:
    """(stage, world size, the one training case)."""
    return [(stage, n, dict(stage=stage, model_kwargs=MEMORY_MODEL, steps=2, batch=24, optimizer="adam"))
            for n in (2, 3)]


def traffic_covered(stage: int) -> str:
    return (f"N={_sizes(n for _, n, _ in traffic_cases(stage))}: reduce-scatter + all-gather"
            f"{' ×2' if stage == 3 else ''}, {3 if stage == 3 else 2}(N−1)/N·Ψ·4 wire bytes")
