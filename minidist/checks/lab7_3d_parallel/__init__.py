"""Lab 7's checks (3D parallelism, the capstone): the mesh's groups, a DP × PP × TP training step
against one process and the cost model, a stage's parameters and a per-rank memory prediction.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (PTD-P, Sec. 3): n = d·p·t ranks in a row-major (d, p, t) grid, TP innermost.
A test cell is a one-liner::

    checks.check_mesh_groups(mesh_groups)                  # pure: against torch's mesh order
    checks.check_train_step_3d(train_step_3d)              # 8 ranks, 2×2×2 1F1B and 1×2×4 GPipe
    checks.check_stage_parameters(stage_parameters)        # pure: against cost.parallel3d.stage_numel
    checks.check_predict_memory(predict_memory)            # pure: against cost.parallel3d
    checks.check_device(train_step_3d)                     # no tensor made off the stage's device

``check_train_step_3d`` runs every layout of the call in one 8-rank launch: losses on every rank and
the stage's weights after 2 SGD steps equal one process's within ``TOL``, the traced step by axis
equals :func:`minidist.cost.parallel3d.step_collectives` (TP and PP exactly; DP's gradient bytes in
any number of all-reduces; the loss report free), the executor's F/B order on each stage equals the
given schedule's, and the caller's ids and targets come back unchanged. ``check_predict_memory``
compares with :func:`minidist.cost.parallel3d.memory_per_rank`, which ``tests/test_mesh.py`` holds
equal to what a run measures; ``measure`` (``demo.py``) gives the notebook those measurements next
to the student's prediction.

Library answers: ``minidist.mesh`` is refused while graded code runs, except the handed-out
:class:`minidist.mesh.GPTStage`; ``predict_memory`` and ``stage_parameters`` may not call
``cost.parallel3d``, the planner, ``cost.pipeline`` or ``cost.data_parallel`` either, except the
handed-out ``stage_activation_bytes`` (one micro-batch's saved bytes on one stage). The cases are in
``cases.py``, the code that runs the student's functions in ``answers.py``, the comparisons in
``verdicts.py`` (docs/AUTHORING.md).
"""
from __future__ import annotations

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab7_3d_parallel import answers, cases, verdicts
from minidist.checks.lab7_3d_parallel.cases import CFG, GRADED, MemoryConfig
from minidist.checks.lab7_3d_parallel.demo import measure

#: what a notebook reads: the test cells' checks, the demo cell's measurement, the model and a rank's config
__all__ = ["CHECKS", "REFUSED", "GRADED", "CFG", "MemoryConfig", "check_mesh_groups", "check_train_step_3d",
           "check_stage_parameters", "check_predict_memory", "check_device", "measure"]

_MESH = Refusal("the 3D mesh and training step", ("minidist.mesh",), allow=("minidist.mesh.stage.GPTStage",),
                checks=__name__)
_MEMORY = Refusal("the 3D memory model", ("minidist.mesh", "minidist.cost.parallel3d", "minidist.cost.planner",
                                         "minidist.cost.pipeline", "minidist.cost.data_parallel"),
                  allow=("minidist.cost.parallel3d.stage_activation_bytes",), checks=__name__)
#: what each graded function may not call
REFUSED = {"mesh_groups": _MESH, "train_step_3d": _MESH, "stage_parameters": _MEMORY, "predict_memory": _MEMORY}

CHECKS = Registry(__name__)
MESH = CHECKS.check("mesh_groups", cases.mesh_cases, answers.groups, verdicts.groups, refusal=_MESH,
                    covered=cases.mesh_covered)
# the mesh, the stage and the optimizer are built on each rank before the step, outside the refusal
# (cases.setup): the whole answer runs under it
STEP = CHECKS.check("train_step_3d", cases.step_cases, answers.train_step, verdicts.train_step, where="launch",
                    world=lambda case: case[0], refusal=_MESH, covered=cases.step_covered, launch=cases.step_launch,
                    timeout=cases.STEP_TIMEOUT)
STAGES = CHECKS.check("stage_parameters", cases.stage_cases, answers.stages, verdicts.stages, refusal=_MEMORY,
                      covered=cases.stage_covered)
MEMORY = CHECKS.check("predict_memory", cases.memory_cases, answers.memory, verdicts.memory, refusal=_MEMORY,
                      covered=cases.memory_covered)
DEVICE = CHECKS.devices(STEP)


@CHECKS.entry(MESH)
def check_mesh_groups(fn, *, hidden: bool = False) -> None:
    """``fn(world_size, dp, pp, tp)`` -> {"dp": [...], "pp": [...], "tp": [...]}: every group's
    ranks, groups and ranks in torch's ``init_device_mesh`` order (row-major (dp, pp, tp), TP
    innermost); ``ValueError`` when dp·pp·tp is not the world size or a size is not a positive
    integer (hidden: negative, zero and non-integer sizes whose product may still match)."""


@CHECKS.entry(STEP)
def check_train_step_3d(fn, *, hidden: bool = False) -> None:
    """``fn(stage, optimizer, ids, targets, mesh, micro_batches, schedule)`` on 8 ranks: per layout,
    2 SGD steps of the tiny GPT; every rank's returned loss and its stage's weights equal one
    process's within ``TOL``; the traced step's traffic by axis equals ``cost.parallel3d``.
    Visible: 2×2×2 1F1B and 1×2×4 GPipe (m = 2); hidden: 2×4×1 1F1B (m = 4), 4×1×2 GPipe."""


@CHECKS.entry(STAGES)
def check_stage_parameters(fn, *, hidden: bool = False) -> None:
    """``fn(cfg, pp, tp, stage)`` -> the number of parameters one TP rank of pipeline stage ``stage``
    holds, exactly :func:`minidist.cost.parallel3d.stage_numel` (which ``tests/test_mesh.py`` holds
    equal to a built ``GPTStage``'s), for every stage. Visible: the tiny GPT at 2 stages × TP 2 and
    1 stage × TP 4 (both ends on one stage); hidden: 4 stages, no biases, GQA, a 7B model."""


@CHECKS.entry(MEMORY)
def check_predict_memory(fn, *, hidden: bool = False) -> None:
    """``fn(config: MemoryConfig)`` -> {"params", "grads", "optimizer", "activations", "total"}
    bytes on one rank, each within 0.1 % of ``cost.parallel3d.memory_per_rank`` (ZeRO's shards
    may round), total the sum of the parts. Visible: 2×2×2 1F1B and 1×2×4 GPipe, both stages;
    hidden: 4 stages with 1F1B, m < p, SGD, ZeRO 1-3 over d = 4, no biases, GQA, a 7B model."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``train_step_3d`` live: the step check's first visible layout, run with
    torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made without
    ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
