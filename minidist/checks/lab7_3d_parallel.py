"""Lab 7's checks (3D parallelism, the capstone): the mesh's groups, a DP × PP × TP training step
against one process and the cost model, and a per-rank memory prediction.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (PTD-P, Sec. 3): n = d·p·t ranks in a row-major (d, p, t) grid, TP innermost.
A lab test cell is a one-liner::

    checks.check_mesh_groups(mesh_groups)                  # pure: against torch's mesh order
    checks.check_train_step(train_step_3d)                 # 8 ranks, 2×2×2 1F1B and 1×2×4 GPipe
    checks.check_stage_parameters(stage_parameters)        # pure: against cost.parallel3d.stage_numel
    checks.check_predict_memory(predict_memory)            # pure: against cost.parallel3d

``check_train_step`` runs every layout of the call in one 8-rank launch
(:mod:`minidist.checks.lab7_cases`): losses on every rank and the stage's weights after 2
SGD steps equal one process's within ``TOL``, and the traced step by axis equals
:func:`minidist.cost.parallel3d.step_collectives` (TP and PP exactly; DP's gradient bytes in
any number of all-reduces; the loss report free), the executor's F/B order on each stage equals
the given schedule's, and the caller's ids and targets come back unchanged. ``check_predict_memory`` compares with
:func:`minidist.cost.parallel3d.memory_per_rank`, which ``tests/test_mesh.py`` holds equal to
what a run measures (model states exactly, activations with saved-tensor hooks);
``measure`` gives the notebook those measurements next to the student's prediction.

Library answers (``minidist.checks.kit.launch``): ``minidist.mesh`` is refused while graded code
runs, except the handed-out :class:`minidist.mesh.GPTStage`; ``predict_memory`` may not call
``cost.parallel3d``, the planner, ``cost.pipeline`` or ``cost.data_parallel`` either, except the
handed-out ``stage_activation_bytes`` (one micro-batch's saved bytes on one stage).
"""
from __future__ import annotations

import dataclasses
import functools

from minidist.checks.kit.launch import TOL, check_timeout, launch_named, one_thread, report_passed
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, from_raising, judged, outcome
from minidist.checks.kit.returned import require_plain
from minidist.checks.lab7_cases import BATCH, CFG, LR, OPTIMIZER, STEPS, WORLD, Layout, step_body, step_failure
from minidist.checks.kit.quiet import passes_quietly
from minidist.cost.parallel3d import memory_per_rank, stage_numel
from minidist.harness.parallel3d import reference_run
from minidist.mesh import mesh_groups as _mesh_groups
from minidist.models import GPTConfig

# One 8-rank launch trains several layouts: on 2 busy cores it legitimately takes seconds, more than the
# quick selftest's 4 s deadlock timeout. No lab-7 bug deadlocks, so the floor costs the selftest nothing.
STEP_CHECK_TIMEOUT = max(check_timeout(30.0), 15.0)
GRADED = ("mesh_groups", "train_step_3d", "stage_parameters", "predict_memory")

_MESH = Refusal("the 3D mesh and training step", ("minidist.mesh",), allow=("minidist.mesh.stage.GPTStage",),
                checks=__name__)
_MEMORY = Refusal("the 3D memory model", ("minidist.mesh", "minidist.cost.parallel3d", "minidist.cost.planner",
                                         "minidist.cost.pipeline", "minidist.cost.data_parallel"),
                  allow=("minidist.cost.parallel3d.stage_activation_bytes",), checks=__name__)
REFUSED = {"mesh_groups": _MESH, "train_step_3d": _MESH, "stage_parameters": _MEMORY, "predict_memory": _MEMORY}


# ----------------------------------------------------------------------------- mesh_groups
MESH_CASES = [(8, 2, 2, 2), (8, 1, 2, 4), (8, 4, 1, 2)]
MESH_HIDDEN = [(16, 2, 2, 4), (24, 2, 3, 4), (12, 3, 2, 2), (6, 1, 3, 2), (4, 4, 1, 1), (4, 1, 1, 4),
               (1, 1, 1, 1), (64, 2, 4, 8), (30, 5, 3, 2)]
MESH_BAD = [(8, 2, 2, 4), (8, 2, 3, 2), (16, 2, 2, 2),
            (8, -2, -2, 2), (8, 2, -1, -4), (-8, -2, 2, 2), (0, 0, 1, 1),      # products fine, sizes not positive
            (6, 1, 1.5, 4), (5, 2.5, 2, 1), (8, 2, 2, 2.0 + 0.5)]               # ... or not integers

def _as_lists(groups) -> dict | None:
    try:
        return {a: [[int(r) for r in g] for g in groups[a]] for a in ("dp", "pp", "tp")}
    except (KeyError, TypeError, ValueError):
        return None


def _mesh_cases(hidden: bool) -> list[tuple]:
    """("good", case) for the meshes, ("bad", case) for the sizes that must raise ValueError."""
    good = MESH_CASES + (MESH_HIDDEN if hidden else [])
    bad = MESH_BAD[:1] + (MESH_BAD[1:] if hidden else [])
    return [("good", c) for c in good] + [("bad", c) for c in bad]


def _mesh_verdict(case, answer) -> str | None:
    kind, (n, dp, pp, tp) = case
    call = f"mesh_groups(world_size={n}, dp={dp}, pp={pp}, tp={tp})"
    if kind == "bad":
        why = (f"{dp}·{pp}·{tp} = {dp * pp * tp} ranks is not the world's {n}" if dp * pp * tp != n
               else "a size is not a positive integer")
        if answer.get("raised") == "ValueError":
            return None
        if "raised" in answer:
            return f"{call} raised {answer['raised']} ({answer.get('message')}); the lab asks for ValueError: {why}"
        return f"{call} returned instead of raising ValueError: {why}"
    lists = _as_lists(answer)
    if lists is None:
        return f"{call} returned {answer!r}: expected a dict with keys 'dp', 'pp', 'tp', each a list of rank lists"
    want = _mesh_groups(n, dp, pp, tp)
    for axis in ("tp", "pp", "dp"):
        if lists[axis] != want[axis]:
            return (f"{call}: the {axis.upper()} groups are {lists[axis]}, torch's mesh has {want[axis]} (rank = "
                    f"(i_dp·pp + i_pp)·tp + i_tp; one group per setting of the other two coordinates, in "
                    "row-major order of those)")
    return None


JUDGED_MESH = Judged(__name__, "mesh_groups", _mesh_cases, _mesh_verdict)


@judged(JUDGED_MESH)
@passes_quietly
def check_mesh_groups(fn, hidden: bool = False) -> None:
    """``fn(world_size, dp, pp, tp)`` -> {"dp": [...], "pp": [...], "tp": [...]}: every group's
    ranks, groups and ranks in torch's ``init_device_mesh`` order (row-major (dp, pp, tp), TP
    innermost); ``ValueError`` when dp·pp·tp is not the world size or a size is not a positive
    integer (hidden: negative, zero and non-integer sizes whose product may still match)."""
    for i, (kind, case) in enumerate(JUDGED_MESH.cases(hidden=hidden)):
        if kind == "good":
            answer = graded_call(_MESH, "mesh_groups", fn, *case)
            require_plain(f"mesh_groups{case}", answer)
        else:
            answer = outcome(lambda: graded_call(_MESH, "mesh_groups", fn, *case))
        JUDGED_MESH.require(dict(hidden=hidden), i, (kind, case), answer)
    report_passed("mesh_groups", f"{len(MESH_CASES) + (len(MESH_HIDDEN) if hidden else 0)} meshes vs torch's order"
                  f"; ValueError for {1 + (len(MESH_BAD) - 1 if hidden else 0)} bad sizes"
                  + (" (products, negative, zero, non-integer)" if hidden else ""), hidden)


# ----------------------------------------------------------------------------- train_step_3d
STEP_LAYOUTS = [Layout(2, 2, 2, "1f1b", 2), Layout(1, 2, 4, "gpipe", 2)]
STEP_HIDDEN = [Layout(2, 4, 1, "1f1b", 4), Layout(4, 1, 2, "gpipe", 2)]


@functools.lru_cache(maxsize=1)
def _reference():
    """One process on the full batch: (losses, final state dict); the same for every layout."""
    with one_thread():
        return reference_run(CFG, STEPS, BATCH, optimizer=OPTIMIZER, lr=LR)


def _step_equal(layout, rows) -> None:
    """Every rank's run of ``layout`` (its row as plain data) against one process."""
    ref_losses = _reference()[0]
    for rank in range(WORLD):
        problem = step_failure("train_step_3d", layout, rank, rows[rank], ref_losses, TOL)
        if problem:
            raise AssertionError(problem)


#: Judged (minidist.checks.kit.docket): the child files every rank's rows per layout; the judge compares again
JUDGED_STEP = Judged(__name__, "train_step_3d", lambda hidden: STEP_HIDDEN if hidden else STEP_LAYOUTS,
                     from_raising(_step_equal))


@judged(JUDGED_STEP)
@passes_quietly
def check_train_step(fn, hidden: bool = False, timeout: float = STEP_CHECK_TIMEOUT) -> None:
    """``fn(stage, optimizer, ids, targets, mesh, micro_batches, schedule)`` on 8 ranks: per layout,
    2 SGD steps of the tiny GPT; every rank's returned loss and its stage's weights equal one
    process's within ``TOL``; the traced step's traffic by axis equals ``cost.parallel3d``.
    Visible: 2×2×2 1F1B and 1×2×4 GPipe (m = 2); hidden: 2×4×1 1F1B (m = 4), 4×1×2 GPipe."""
    layouts = JUDGED_STEP.cases(hidden=hidden)
    out = launch_named(step_body, WORLD, fn, "train_step_3d", layouts, _reference()[1], _MESH, name="train_step_3d",
                       timeout=timeout)
    for i, layout in enumerate(layouts):
        JUDGED_STEP.require(dict(hidden=hidden), i, layout, [out[rank][i] for rank in range(WORLD)])
    report_passed("train_step_3d", ", ".join(x.name for x in layouts) + ": losses, weights, traffic by axis, "
                  "the schedule's F/B order, inputs unchanged", hidden)


# ----------------------------------------------------------------------------- predict_memory
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


def expected_memory(c: MemoryConfig) -> dict:
    return memory_per_rank(c.cfg, c.dp, c.pp, c.tp, c.stage, batch=c.batch, micro_batches=c.micro_batches,
                           schedule=c.schedule, zero_stage=c.zero_stage, elem_bytes=c.elem_bytes,
                           optimizer=c.optimizer)


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


def _memory_verdict(c: MemoryConfig, answer, rel: float = 1e-3) -> str | None:
    if not isinstance(answer, dict) or any(k not in answer for k in PARTS + ("total",)):
        return f"predict_memory returned {answer!r}: expected a dict with keys {', '.join(PARTS + ('total',))}"
    try:
        got = {k: float(answer[k]) for k in PARTS + ("total",)}
    except (TypeError, ValueError):
        return f"predict_memory({c}) returned {answer!r}: expected numbers of bytes"
    want = expected_memory(c)
    for k in PARTS:
        if not abs(got[k] - want[k]) <= rel * max(want[k], 1):
            return f"predict_memory({c}): {k} = {got[k]:.6g} bytes, expected {want[k]:.6g}"
    if not abs(got["total"] - sum(got[k] for k in PARTS)) <= rel * max(want["total"], 1):
        return f"predict_memory({c}): total {answer['total']} is not the sum of the parts"
    return None


JUDGED_MEMORY = Judged(__name__, "predict_memory", lambda hidden: MEMORY_CASES + (MEMORY_HIDDEN if hidden else []),
                _memory_verdict)


@judged(JUDGED_MEMORY)
@passes_quietly
def check_predict_memory(fn, hidden: bool = False) -> None:
    """``fn(config: MemoryConfig)`` -> {"params", "grads", "optimizer", "activations", "total"}
    bytes on one rank, each within 0.1 % of ``cost.parallel3d.memory_per_rank`` (ZeRO's shards
    may round), total the sum of the parts. Visible: 2×2×2 1F1B and 1×2×4 GPipe, both stages;
    hidden: 4 stages with 1F1B, m < p, SGD, ZeRO 1-3 over d = 4, no biases, GQA, a 7B model."""
    for i, c in enumerate(JUDGED_MEMORY.cases(hidden=hidden)):
        answer = graded_call(_MEMORY, "predict_memory", fn, c)
        require_plain(f"predict_memory({c})", answer)
        JUDGED_MEMORY.require(dict(hidden=hidden), i, c, answer)
    report_passed("predict_memory", f"{len(MEMORY_CASES) + (len(MEMORY_HIDDEN) if hidden else 0)} ranks' params, "
                  "grads, optimizer, activations vs cost.parallel3d"
                  + (" (1F1B/GPipe, SGD, ZeRO 1-3, no bias, GQA, 7B)" if hidden else ""), hidden)


# ----------------------------------------------------------------------------- stage_parameters
#: (cfg, pp, tp): every stage of each
STAGE_CASES = [(CFG, 2, 2), (CFG, 1, 4)]
STAGE_HIDDEN = [(CFG, 4, 1), (_NO_BIAS, 2, 2), (_GQA, 3, 2), (_GQA, 1, 1), (_BIG, 4, 4), (_BIG, 8, 8)]


def _stage_cases(hidden: bool) -> list[tuple]:
    return [(cfg, pp, tp, stage) for cfg, pp, tp in STAGE_CASES + (STAGE_HIDDEN if hidden else [])
            for stage in range(pp)]


def _stage_verdict(case, answer) -> str | None:
    cfg, pp, tp, stage = case
    want = stage_numel(cfg, pp, tp, stage)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and answer == want:
        return None
    return (f"stage_parameters(cfg with d_model={cfg.d_model}, n_layers={cfg.n_layers}, vocab={cfg.vocab}, "
            f"n_kv_heads={cfg.n_kv_heads}, bias={cfg.bias}; pp={pp}, tp={tp}, stage={stage}) = {answer!r}, "
            f"expected {want} (stage 0 adds the embeddings, the last stage the final LayerNorm and the head)")


JUDGED_STAGES = Judged(__name__, "stage_parameters", _stage_cases, _stage_verdict)


@judged(JUDGED_STAGES)
@passes_quietly
def check_stage_parameters(fn, hidden: bool = False) -> None:
    """``fn(cfg, pp, tp, stage)`` -> the number of parameters one TP rank of pipeline stage ``stage``
    holds, exactly :func:`minidist.cost.parallel3d.stage_numel` (which ``tests/test_mesh.py`` holds
    equal to a built ``GPTStage``'s), for every stage. Visible: the tiny GPT at 2 stages × TP 2 and
    1 stage × TP 4 (both ends on one stage); hidden: 4 stages, no biases, GQA, a 7B model."""
    for i, case in enumerate(JUDGED_STAGES.cases(hidden=hidden)):
        cfg, pp, tp, stage = case
        answer = graded_call(_MEMORY, "stage_parameters", fn, *case)
        require_plain(f"stage_parameters(pp={pp}, tp={tp}, stage={stage})", answer)
        JUDGED_STAGES.require(dict(hidden=hidden), i, case, answer)
    n = len(STAGE_CASES) + (len(STAGE_HIDDEN) if hidden else 0)
    report_passed("stage_parameters", f"{n} layouts, every stage, exact counts"
                  + (" (no bias, GQA, 7B)" if hidden else ""), hidden)


# ----------------------------------------------------------------------------- measurements (demo cells)
@passes_quietly
def measure(train_step_3d, layouts=None, timeout: float = STEP_CHECK_TIMEOUT) -> list[dict]:
    """One 8-rank launch of your step on ``layouts`` (default: the visible ones and
    2×4×1 1F1B): per layout and rank, the losses' error vs one process, the traced bytes by
    axis, the model states held after the step (``minidist.memory.model_state_bytes``) and the
    activation peak the executor measured (``ActivationMeter``), with the cost model's numbers."""
    layouts = list(layouts or STEP_LAYOUTS + STEP_HIDDEN[:1])
    ref_losses, ref_state = _reference()
    out = launch_named(step_body, WORLD, train_step_3d, "train_step_3d", layouts, ref_state, None, True,
                       name="measure", timeout=timeout)
    rows = []
    for i, layout in enumerate(layouts):
        for rank in range(WORLD):
            r = out[rank][i]
            c = MemoryConfig(CFG, layout.dp, layout.pp, layout.tp, r["stage"], BATCH, layout.micro_batches,
                             layout.schedule, OPTIMIZER)
            rows.append({"layout": layout.name, "rank": rank, "stage": r["stage"], "config": c,
                         "loss_err": max(abs(a - b) for a, b in zip(r["losses"], ref_losses)),
                         "bytes": {a: sum(n for _, n in r["traffic"][a]) for a in ("dp", "pp", "tp")},
                         "model_states": r["model_states"]["total"], "activations": r["activations"],
                         "theory": expected_memory(c)})
    return rows
