"""Lab 7's cases (3D parallelism): the meshes, the stages whose parameters are counted, the ranks
whose memory is predicted, the layouts the 3D step trains, their inputs, and what a passing test's
✓ line says it covered.

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
STEP_CHECK_TIMEOUT = max(check_timeout(30.0), 15.0)

# ----------------------------------------------------------------------------- mesh_groups
MESH_CASES = [(8, 2, 2, 2), (8, 1, 2, 4), (8, 4, 1, 2)]
MESH_HIDDEN = [(16, 2, 2, 4), (24, 2, 3, 4), (12, 3, 2, 2), (6, 1, 3, 2), (4, 4, 1, 1), (4, 1, 1, 4),
               (1, 1, 1, 1), (64, 2, 4, 8), (30, 5, 3, 2)]
MESH_BAD = [(8, 2, 2, 4), (8, 2, 3, 2), (16, 2, 2, 2),
            (8, -2, -2, 2), (8, 2, -1, -4), (-8, -2, 2, 2), (0, 0, 1, 1),      # products fine, sizes not positive
            (6, 1, 1.5, 4), (5, 2.5, 2, 1), (8, 2, 2, 2.0 + 0.5)]               # ... or not integers


def mesh_cases(hidden: bool) -> list[tuple]:
    """("good", sizes) for the meshes, ("bad", sizes) for the sizes that must raise ValueError."""
    good = MESH_CASES + (MESH_HIDDEN if hidden else [])
    bad = MESH_BAD[:1] + (MESH_BAD[1:] if hidden else [])
    return [("good", c) for c in good] + [("bad", c) for c in bad]


def mesh_covered(hidden: bool) -> str:
    return (f"{len(MESH_CASES) + (len(MESH_HIDDEN) if hidden else 0)} meshes vs torch's order; ValueError for "
            f"{1 + (len(MESH_BAD) - 1 if hidden else 0)} bad sizes"
            + (" (products, negative, zero, non-integer)" if hidden else ""))


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


_NO_BIAS = dataclasses.replace(CFG, bias=False)
_GQA = GPTConfig(vocab=64, d_model=32, n_heads=8, n_kv_heads=2, n_layers=6, seq_len=16, d_ff=96)
_BIG = GPTConfig(vocab=32000, d_model=4096, n_heads=32, n_layers=32, seq_len=4096, d_ff=16384)
MEMORY_CASES = [MemoryConfig(CFG, 2, 2, 2, s, 8, 2) for s in (0, 1)] + \
               [MemoryConfig(CFG, 1, 2, 4, s, 8, 2, "gpipe") for s in (0, 1)]
MEMORY_HIDDEN = ([MemoryConfig(CFG, 2, 4, 1, s, 8, 4) for s in range(4)]          # 1F1B: p - stage in flight
                 + [MemoryConfig(CFG, 1, 4, 2, s, 8, 2) for s in (0, 3)]          # ... at most m
                 + [MemoryConfig(CFG, 4, 1, 2, 0, 8, 2, "gpipe", "sgd")]
                 + [MemoryConfig(CFG, 4, 2, 1, s, 16, 2, zero_stage=z) for s in (0, 1) for z in (1, 2, 3)]
                 + [MemoryConfig(_NO_BIAS, 2, 2, 2, 1, 8, 2), MemoryConfig(_GQA, 2, 3, 2, 1, 12, 2, "gpipe"),
                    MemoryConfig(_BIG, 2, 4, 4, 0, 512, 128, zero_stage=1, elem_bytes=2),
                    MemoryConfig(_BIG, 2, 4, 4, 3, 512, 128, zero_stage=1, elem_bytes=2)])
PARTS = ("params", "grads", "optimizer", "activations")


def memory_cases(hidden: bool) -> list[MemoryConfig]:
    return MEMORY_CASES + (MEMORY_HIDDEN if hidden else [])


def memory_covered(hidden: bool) -> str:
    return (f"{len(memory_cases(hidden))} ranks' params, grads, optimizer, activations vs cost.parallel3d"
            + (" (1F1B/GPipe, SGD, ZeRO 1-3, no bias, GQA, 7B)" if hidden else ""))


#: (cfg, pp, tp): every stage of each
STAGE_CASES = [(CFG, 2, 2), (CFG, 1, 4)]
STAGE_HIDDEN = [(CFG, 4, 1), (_NO_BIAS, 2, 2), (_GQA, 3, 2), (_GQA, 1, 1), (_BIG, 4, 4), (_BIG, 8, 8)]


def stage_cases(hidden: bool) -> list[tuple]:
    """(cfg, pp, tp, stage) for every stage of every layout."""
    return [(cfg, pp, tp, stage) for cfg, pp, tp in STAGE_CASES + (STAGE_HIDDEN if hidden else [])
            for stage in range(pp)]


def stage_covered(hidden: bool) -> str:
    n = len(STAGE_CASES) + (len(STAGE_HIDDEN) if hidden else 0)
    return f"{n} layouts, every stage, exact counts" + (" (no bias, GQA, 7B)" if hidden else "")


# ----------------------------------------------------------------------------- train_step_3d
STEP_LAYOUTS = [Layout(2, 2, 2, "1f1b", 2), Layout(1, 2, 4, "gpipe", 2)]
STEP_HIDDEN = [Layout(2, 4, 1, "1f1b", 4), Layout(4, 1, 2, "gpipe", 2)]


def step_cases(hidden: bool) -> list[tuple]:
    """One launch: (8 ranks, the layouts it trains)."""
    return [(WORLD, tuple(STEP_HIDDEN if hidden else STEP_LAYOUTS))]


def step_covered(hidden: bool) -> str:
    layouts = STEP_HIDDEN if hidden else STEP_LAYOUTS
    return ", ".join(x.name for x in layouts) + ": losses, weights, traffic by axis, the schedule's F/B order, inputs unchanged"


def describe(layout: Layout) -> str:
    return f"layout dp={layout.dp} x pp={layout.pp} x tp={layout.tp}, {layout.schedule}, m={layout.micro_batches}"


@functools.lru_cache(maxsize=1)
def one_process():
    """One process on the full batch: (losses, final state dict), the reference of every layout."""
    with one_thread():
        return reference_run(CFG, STEPS, BATCH, optimizer=OPTIMIZER, lr=LR)


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
