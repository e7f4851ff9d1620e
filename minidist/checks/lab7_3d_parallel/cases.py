"""Lab 7's cases (3D parallelism): the meshes, the stages whose parameters are counted, the ranks
whose memory is predicted, the layouts the 3D step trains, their inputs, and what a passing test's
✓ line says it covered. The hidden cases are the grader's, in ``hidden.py``.

Narayanan et al. 2021 (Megatron-LM, PTD-P), Sec. 3: n = d·p·t ranks in a row-major (d, p, t) grid,
TP innermost. The 3D step's case is one launch of 8 ranks, (8, its layouts): forking 8 ranks costs
more than two steps of the tiny model. Per layout, every rank is given torch's ``init_device_mesh``
(dims "dp", "pp", "tp"), its :class:`minidist.mesh.GPTStage` (handed out) and SGD with momentum
(Adam's update hardly depends on a gradient's scale, so a gradient not divided by d would slip
through), all built by :func:`setup` before the student's code runs, outside the refusal. Tensors
live on ``minidist.device()`` and the mesh on its device type.
"""
from __future__ import annotations

import dataclasses
import functools

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from minidist.checks.kit.withheld import hidden_cases
from minidist.checks.kit.launch import check_timeout, one_thread
from minidist.harness.parallel3d import TINY, Layout, reference_run
from minidist.mesh import AXES, GPTStage, coordinate
from minidist.models import GPTConfig, TinyGPT, gpt_batch, make_optimizer
from minidist.runtime.device import device as rank_device

GRADED = ("mesh_groups", "train_step_3d", "stage_parameters", "predict_memory")
WORLD = 8
CFG = TINY                      # vocab 32, d_model 16, 4 heads, 4 layers, seq 8
BATCH, STEPS = 8, 2
OPTIMIZER, LR = "sgd", 0.1
# One 8-rank launch trains several layouts: on 2 busy cores it legitimately takes seconds, more than the
# quick selftest's 4 s deadlock timeout. No lab-7 bug deadlocks, so the floor costs the selftest nothing.
STEP_TIMEOUT = check_timeout(30.0, at_least=15.0)

# ----------------------------------------------------------------------------- mesh_groups
MESH_CASES = [(8, 2, 2, 2), (8, 1, 2, 4), (8, 4, 1, 2)]
MESH_BAD = [(8, 2, 2, 4)]


def mesh_cases(hidden: bool) -> list[tuple]:
    """("good", sizes) for the meshes, ("bad", sizes) for the sizes that must raise ValueError."""
    h = hidden_cases(__package__, "mesh_groups") if hidden else None
    good = MESH_CASES + (h.MESH if hidden else [])
    bad = MESH_BAD + (h.MESH_BAD if hidden else [])
    return [("good", c) for c in good] + [("bad", c) for c in bad]


def mesh_covered(hidden: bool) -> str:
    cases = mesh_cases(hidden)
    return (f"{sum(k == 'good' for k, _ in cases)} meshes vs torch's order; ValueError for "
            f"{sum(k == 'bad' for k, _ in cases)} bad sizes"
            + (f" ({hidden_cases(__package__, 'mesh_groups').MESH_BAD_SHOWN})" if hidden else ""))


# ----------------------------------------------------------------------------- predict_memory, stage_parameters
@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """One rank of a 3D layout: which pipeline stage it holds, the batch, the schedule, the
    optimizer ("adam": two moments; "sgd": momentum) and the ZeRO stage over DP (0-3)."""
    cfg: GPTConfig
    dp: int
    pp: int
    tp: int
    stage: int
    batch: int
    micro_batches: int
    schedule: str = "1f1b"
    optimizer: str = "adam"
    zero_stage: int = 0
    elem_bytes: int = 4


MEMORY_CASES = [MemoryConfig(CFG, 2, 2, 2, s, 8, 2) for s in (0, 1)] + \
               [MemoryConfig(CFG, 1, 2, 4, s, 8, 2, "gpipe") for s in (0, 1)]
PARTS = ("params", "grads", "optimizer", "activations")


def memory_cases(hidden: bool) -> list[MemoryConfig]:
    return MEMORY_CASES + (hidden_cases(__package__, "predict_memory").MEMORY if hidden else [])


def memory_covered(hidden: bool) -> str:
    return (f"{len(memory_cases(hidden))} ranks' params, grads, optimizer, activations vs cost.parallel3d"
            + (f" ({hidden_cases(__package__, 'predict_memory').MEMORY_SHOWN})" if hidden else ""))


#: (cfg, pp, tp): every stage of each
STAGE_CASES = [(CFG, 2, 2), (CFG, 1, 4)]


def _stage_layouts(hidden: bool) -> list[tuple]:
    return STAGE_CASES + (hidden_cases(__package__, "stage_parameters").STAGES if hidden else [])


def stage_cases(hidden: bool) -> list[tuple]:
    """(cfg, pp, tp, stage) for every stage of every layout."""
    return [(cfg, pp, tp, stage) for cfg, pp, tp in _stage_layouts(hidden) for stage in range(pp)]


def stage_covered(hidden: bool) -> str:
    shown = f" ({hidden_cases(__package__, 'stage_parameters').STAGES_SHOWN})" if hidden else ""
    return f"{len(_stage_layouts(hidden))} layouts, every stage, exact counts" + shown


# ----------------------------------------------------------------------------- train_step_3d
STEP_LAYOUTS = [Layout(2, 2, 2, "1f1b", 2), Layout(1, 2, 4, "gpipe", 2)]


def _step_layouts(hidden: bool) -> list[Layout]:
    return hidden_cases(__package__, "train_step_3d").STEP if hidden else STEP_LAYOUTS


def step_cases(hidden: bool) -> list[tuple]:
    """One launch: (8 ranks, the layouts it trains)."""
    return [(WORLD, tuple(_step_layouts(hidden)))]


def step_covered(hidden: bool) -> str:
    layouts = _step_layouts(hidden)
    return ", ".join(x.name for x in layouts) + ": losses, weights, traffic by axis, the schedule's F/B order, inputs unchanged"


def describe(layout: Layout) -> str:
    return f"layout dp={layout.dp} x pp={layout.pp} x tp={layout.tp}, {layout.schedule}, m={layout.micro_batches}"


@functools.lru_cache(maxsize=None)
def one_process(lr_scale: float = 1.0):
    """One process on the full batch: (losses, final state dict), the reference of every layout
    (``lr_scale``: SGD with every gradient that many times too large, for a verdict's diagnosis)."""
    with one_thread():
        return reference_run(CFG, STEPS, BATCH, optimizer=OPTIMIZER, lr=LR * lr_scale)


def batch(step: int, device="cpu"):
    """The step's (ids, targets), the same on every rank and in one process."""
    return gpt_batch(step, BATCH, CFG.seq_len, CFG.vocab, device=device)


@dataclasses.dataclass
class Given:
    """What a rank is given for one layout (the mesh, its stage, the optimizer), and one process's
    weights after the steps, cut as this rank's stage is (the rank's groups make the cut)."""
    mesh: object
    stage: GPTStage
    optimizer: object
    i_pp: int
    expected: dict


def step_launch(case) -> dict:
    """The step check's launch options: one process's run here, once (the ranks are given its final
    weights), and :func:`setup` on every rank before the student's code."""
    return {"reference": functools.partial(setup, state=one_process()[1])}


def setup(case, state: dict) -> list[Given]:
    """On every rank, outside the refusal (``minidist.mesh`` is refused in graded code): per layout of
    the launch ``case``, torch's mesh on this rank's device type ("cuda" under NCCL, "cpu" under gloo),
    the stage, SGD with momentum, and one process's final weights (``state``) cut the same way."""
    rank, out = dist.get_rank(), []
    for layout in case[1]:
        mesh = init_device_mesh(rank_device().type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=AXES)
        i_pp = coordinate(rank, layout.dp, layout.pp, layout.tp)[1]
        tp_group = mesh.get_group("tp")
        stage = GPTStage(TinyGPT(CFG), i_pp, layout.pp, tp_group)
        optimizer = make_optimizer([p for p in stage.parameters() if p.requires_grad], OPTIMIZER, LR)
        ref = TinyGPT(CFG)
        ref.load_state_dict(state)
        expected = {name: p.detach().to("cpu", copy=True)
                    for name, p in GPTStage(ref, i_pp, layout.pp, tp_group).named_parameters()}
        out.append(Given(mesh, stage, optimizer, i_pp, expected))
    return out
