"""Lab 7's verdicts: the mesh's groups against torch's order, a stage's parameter count and a rank's
memory against :mod:`minidist.cost.parallel3d`, and every rank's 3D step against one process, the
schedule it was given and the traffic the cost model predicts by axis.

The step's verdict reads, per layout and rank, what :func:`~minidist.checks.lab7_3d_parallel.answers.steps`
recorded: the losses (against one process's, rebuilt here), the stage's weights next to one
process's cut the same way in the rank (the cut needs the rank's groups), the caller's ids and
targets (digests), the executor's F/B spans and the collectives of the last step (its trace).
"""
from __future__ import annotations

from collections import Counter

import torch

from minidist import mesh
from minidist.checks.kit.compare import tensor_error, untouched
from minidist.checks.kit.diagnosis import likely_cause
from minidist.checks.kit.launch import TOL
from minidist.checks.kit.returned import returned_problem
from minidist.checks.lab7_3d_parallel.cases import BATCH, CFG, PARTS, MemoryConfig, batch, one_process
from minidist.cost.parallel3d import memory_per_rank, stage_numel, step_collectives
from minidist.harness.parallel3d import Layout, axis_of
from minidist.pipeline import make

SMALL = 16                      # a collective of at most this many bytes is a loss report, in any form
P2P = ("isend", "irecv", "send", "recv")
#: how far a predicted part of the memory may be from the cost model's (ZeRO's shards may round)
MEMORY_REL = 1e-3


# ----------------------------------------------------------------------------- mesh_groups
def _as_lists(found) -> dict | None:
    try:
        return {a: [[int(r) for r in g] for g in found[a]] for a in ("dp", "pp", "tp")}
    except (KeyError, TypeError, ValueError):
        return None


def groups(case, answer) -> str | None:
    """torch's ``init_device_mesh`` order (row-major (dp, pp, tp), TP innermost), or ValueError."""
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
    if problem := returned_problem(answer):
        return problem
    lists = _as_lists(answer["returned"])
    if lists is None:
        return (f"{call} returned {answer['returned']!r}: expected a dict with keys 'dp', 'pp', 'tp', each a list "
                f"of rank lists")
    want = mesh.mesh_groups(n, dp, pp, tp)
    for axis in ("tp", "pp", "dp"):
        if lists[axis] != want[axis]:
            return (f"{call}: the {axis.upper()} groups are {lists[axis]}, torch's mesh has {want[axis]} (rank = "
                    f"(i_dp·pp + i_pp)·tp + i_tp; one group per setting of the other two coordinates, in "
                    "row-major order of those)")
    return None


# ----------------------------------------------------------------------------- stage_parameters, predict_memory
def stages(case, answer) -> str | None:
    """Exactly :func:`minidist.cost.parallel3d.stage_numel`."""
    if problem := returned_problem(answer):
        return problem
    cfg, pp, tp, stage = case
    got, want = answer["returned"], stage_numel(cfg, pp, tp, stage)
    if isinstance(got, (int, float)) and not isinstance(got, bool) and got == want:
        return None
    return (f"stage_parameters(cfg with d_model={cfg.d_model}, n_layers={cfg.n_layers}, vocab={cfg.vocab}, "
            f"n_kv_heads={cfg.n_kv_heads}, bias={cfg.bias}; pp={pp}, tp={tp}, stage={stage}) = {got!r}, "
            f"expected {want} (stage 0 adds the embeddings, the last stage the final LayerNorm and the head)")


def expected_memory(c: MemoryConfig) -> dict:
    return memory_per_rank(c.cfg, c.dp, c.pp, c.tp, c.stage, batch=c.batch, micro_batches=c.micro_batches,
                           schedule=c.schedule, zero_stage=c.zero_stage, elem_bytes=c.elem_bytes,
                           optimizer=c.optimizer)


def memory(c: MemoryConfig, answer) -> str | None:
    """Each part within 0.1 % of :func:`minidist.cost.parallel3d.memory_per_rank` (ZeRO's shards may
    round), the total the sum of the parts."""
    if problem := returned_problem(answer):
        return problem
    got = answer["returned"]
    if not isinstance(got, dict) or any(k not in got for k in PARTS + ("total",)):
        return f"predict_memory returned {got!r}: expected a dict with keys {', '.join(PARTS + ('total',))}"
    try:
        parts = {k: float(got[k]) for k in PARTS + ("total",)}
    except (TypeError, ValueError):
        return f"predict_memory({c}) returned {got!r}: expected numbers of bytes"
    want, rel = expected_memory(c), MEMORY_REL
    for k in PARTS:
        if not abs(parts[k] - want[k]) <= rel * max(want[k], 1):
            return f"predict_memory({c}): {k} = {parts[k]:.6g} bytes, expected {want[k]:.6g}"
    if not abs(parts["total"] - sum(parts[k] for k in PARTS)) <= rel * max(want["total"], 1):
        return f"predict_memory({c}): total {got['total']} is not the sum of the parts"
    return None


# ----------------------------------------------------------------------------- train_step_3d
def traffic_by_axis(events, rank: int, layout: Layout) -> dict[str, list[tuple[str, int]]]:
    """A rank's traced collectives by axis, (op, payload bytes); a group of one rank moves nothing
    and is left out, a group that is none of the rank's mesh groups goes under "other"."""
    out = {a: [] for a in (*mesh.AXES, "other")}
    for e in events:
        if e.op == "barrier" or (e.group is not None and len(e.group) == 1):
            continue
        try:
            axis = axis_of(e.group, rank, layout)
        except ValueError:
            axis = "other"
        out[axis].append((e.op, e.nbytes))
    return out


def _large(items) -> list[tuple[str, int]]:
    return sorted((op, n) for op, n in items if op in P2P or n > SMALL)


def traffic_problem(got: dict, layout: Layout, stage: int) -> str | None:
    """None when the traced step matches ``cost.parallel3d.step_collectives``: TP's and PP's
    collectives and messages exactly (kind, bytes), DP's gradient all-reduces in any number of
    calls summing to the stage's gradient bytes (or ZeRO-1's reduce-scatter + all-gather of the
    same bytes); the loss report (collectives of <= 16 bytes) is free in form and group."""
    want = step_collectives(CFG, layout.dp, layout.pp, layout.tp, stage, batch=BATCH,
                            micro_batches=layout.micro_batches)
    want = {a: [(c.op, c.nbytes) for c in want[a]] for a in mesh.AXES}
    for axis in ("tp", "pp"):
        g, w = _large(got[axis]), _large(want[axis])
        if g != w:
            extra, missing = Counter(g) - Counter(w), Counter(w) - Counter(g)
            return (f"traffic over the {axis.upper()} group differs from cost.parallel3d: unexpected "
                    f"{sorted(extra.elements()) or 'nothing'}, missing {sorted(missing.elements()) or 'nothing'} "
                    "((op, payload bytes))")
    g, w = _large(got["dp"]), _large(want["dp"])
    grads, ops = sum(n for _, n in w), {op for op, _ in g}
    all_reduced = ops == {"all_reduce"} and sum(n for _, n in g) == grads
    # ZeRO-1 over DP (the lab's going further): reduce-scatter the (padded) flat gradient, all-gather
    # the updated shards; the tracer counts an all-gather's input shard, list form or not
    rs = sum(n for op, n in g if op in ("reduce_scatter_tensor", "reduce_scatter"))
    ag = sum(n for op, n in g if op in ("all_gather_into_tensor", "all_gather"))
    zero1 = (ops <= {"reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather"}
             and grads <= rs <= grads + 4 * (layout.dp - 1) and ag * layout.dp == rs)
    if not (all_reduced or zero1):
        return (f"gradient traffic over the DP group: {sum(n for _, n in g)} bytes in {sorted(Counter(g).items())}; "
                f"expected all-reduces of the stage's {grads} gradient bytes (one flat buffer or one per "
                "parameter), or ZeRO-1's reduce-scatter of them and all-gather of the updated shards")
    if _large(got["other"]):
        return f"collectives over groups that are none of this rank's mesh groups: {_large(got['other'])}"
    return None


def schedule_problem(events, layout: Layout, stage: int) -> str | None:
    """The step must run the schedule it was asked for: the order of the executor's forward and
    backward spans on this stage equals ``make(schedule, pp, m).compute(stage)``'s."""
    got = [(e.op[len("span:"):], e.meta.get("mb")) for e in events if e.op in ("span:F", "span:B")]
    want = [(a.kind, a.mb) for a in make(layout.schedule, layout.pp, layout.micro_batches).compute(stage)]
    if got == want:
        return None
    show = lambda xs: " ".join(f"{k}{mb}" for k, mb in xs) or "nothing"     # noqa: E731
    return (f"the step ran {show(got)} on stage {stage}; the {layout.schedule} schedule it was given runs "
            f"{show(want)} (build it with make(schedule, pp, micro_batches) and run it with run_schedule)")


def train_step(case, answers) -> str | None:
    """Every rank's run of every layout of the launch (8, layouts), layout by layout."""
    world, layouts = case
    for i, layout in enumerate(layouts):
        for rank in range(world):
            problem = step_failure("train_step_3d", layout, rank, answers[rank][i])
            if problem:
                return problem
    return None


def step_failure(name: str, layout: Layout, rank: int, row: dict) -> str | None:
    """The first thing wrong with one rank's run of one layout (its row, as plain data), in words:
    its losses against one process's, its weights against one process's cut the same way, the
    caller's ids and targets, the schedule it ran and its traffic by axis (the last step's trace)."""
    where = (f"{name}, layout dp={layout.dp} x pp={layout.pp} x tp={layout.tp} ({layout.schedule}, "
             f"m={layout.micro_batches}), rank {rank} at (dp, pp, tp) = "
             f"{mesh.coordinate(rank, layout.dp, layout.pp, layout.tp)}")
    ref_losses = one_process()[0]
    for step, (got, want) in enumerate(zip(row["losses"], ref_losses)):
        if not abs(got - want) <= TOL:
            hint = (" (the loss on every rank is the global batch's mean: the last stage's over PP, "
                    "averaged over DP)" if step == 0 else
                    " (step 0 matched: the update differs, i.e. the gradients were reduced over the wrong "
                    "group or scaled wrong)")
            cause = (likely_cause(torch.tensor([got]), torch.tensor([want]), TOL, sizes(layout)) if step == 0
                     else scaled_gradients(row["losses"], layout))
            return f"{where}: loss at step {step} is {got:.6f}, one process gets {want:.6f}{hint}" + (
                f"; {cause}" if cause else "")
    if len(row["losses"]) != len(ref_losses):
        return f"{where}: {len(row['losses'])} losses for {len(ref_losses)} steps"
    weights, expected = row["weights"], row["expected"]
    if sorted(weights) != sorted(expected):
        return f"{where}: the stage's parameters are {sorted(weights)}, expected {sorted(expected)}"
    for pname, want in expected.items():       # within TOL absolute, as the losses (weights reach 4 here)
        if problem := tensor_error(pname, weights[pname], want, tol=0.0, slack=TOL,
                                   against="one process's, cut the same way"):
            return (f"{where}: after {len(ref_losses)} steps the weights differ from one process's: {problem} "
                    "(gradients reduced over the wrong group, or not averaged: mean over the global batch = "
                    "sum over DP / d)")
    if len(row["inputs"]) != len(ref_losses):
        return f"{where}: the caller's ids and targets were recorded after {len(row['inputs'])} of {len(ref_losses)} steps"
    for step, after in enumerate(row["inputs"]):
        if len(after) != 2:
            return f"{where}: {len(after)} digests of the caller's (ids, targets) after step {step}"
        names = ("ids", "targets")
        if problem := untouched(dict(zip(names, after)), dict(zip(names, batch(step))), f"step {step}"):
            return f"{where}: {problem}"
    stage = mesh.coordinate(rank, layout.dp, layout.pp, layout.tp)[1]
    problem = (schedule_problem(row["trace"].events, layout, stage)
               or traffic_problem(traffic_by_axis(row["trace"].comm(), rank, layout), layout, stage))
    return f"{where}: {problem}" if problem else None


def sizes(layout: Layout) -> dict:
    """The layout's sizes by the names the lab gives them (d × p × t, m micro-batches), for a
    diagnosis that finds a constant factor."""
    return {"d": layout.dp, "p": layout.pp, "t": layout.tp, "m": layout.micro_batches}


def scaled_gradients(losses: list, layout: Layout) -> str:
    """"likely cause: ..." when the losses are one process's with every gradient scaled by one of the
    layout's sizes (SGD: a gradient c times too large is a learning rate c times too large), else ""."""
    named = sizes(layout)
    for c in sorted({v for v in named.values() if v > 1}):
        for factor, how in ((c, "times"), (1 / c, "divided by")):
            if all(abs(a - b) <= TOL for a, b in zip(losses, one_process(factor)[0])):
                label = " = ".join([f"{c:g}"] + [name for name, v in named.items() if v == c])
                return (f"likely cause: these are one process's losses with every gradient {how} {label} (an "
                        f"average over the wrong group, a sum not divided by d, or a loss scaled twice?)")
    return ""
