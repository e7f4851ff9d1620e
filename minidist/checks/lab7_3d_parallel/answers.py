"""Lab 7's answers: what the student's mesh_groups, stage_parameters and predict_memory return in
this process, and what their 3D step does on every rank (the only code of this lab's checks that
calls student code).

A pure answer is the kit's record of the value returned (:func:`minidist.checks.kit.returned.returned`:
an object of the student's own class would run its code in the verdict, outside the refusal); a size
that must be refused is what the call did (:func:`minidist.checks.kit.raises.outcome`).
"""
from __future__ import annotations

import contextlib

from minidist.checks.kit.compare import digest
from minidist.checks.kit.raises import outcome
from minidist.checks.kit.launch import one_thread
from minidist.checks.kit.returned import returned
from minidist.checks.kit.run import mark
from minidist.checks.lab7_3d_parallel.cases import STEPS, batch, describe
from minidist.memory import model_state_bytes
from minidist.runtime.device import device as rank_device
from minidist.trace import trace


def groups(fn, case) -> dict:
    """``fn(world_size, dp, pp, tp)``: its groups, or, for sizes it must refuse, what the call did."""
    kind, sizes = case
    if kind == "bad":
        return outcome(lambda: fn(*sizes))
    return returned(fn(*sizes), f"mesh_groups{sizes}")


def stages(fn, case) -> dict:
    cfg, pp, tp, stage = case
    return returned(fn(*case), f"stage_parameters(pp={pp}, tp={tp}, stage={stage})")


def memory(fn, config) -> dict:
    return returned(fn(config), f"predict_memory({config})")


def train_step(fn, case, reference) -> list:
    """On every rank of the launch ``case`` = (8, layouts): :func:`steps`, on what ``reference``
    (:func:`~minidist.checks.lab7_3d_parallel.cases.setup`) built for each layout before."""
    return steps(fn, case[1], reference, mark)


def steps(fn, layouts, given, mark_layout, around=contextlib.nullcontext) -> list[dict]:
    """Inside a rank: per layout, ``STEPS`` calls of ``fn(stage, optimizer, ids, targets, mesh,
    micro_batches, schedule)`` on what ``given`` holds for it, the last traced; returns per layout
    the losses, digests of the caller's ids and targets after each step, the stage's weights after
    the steps next to one process's cut the same way, the last step's trace and the model states
    held (:func:`minidist.memory.model_state_bytes`). ``around(fn)``: a context around each call (the
    demo's measurement of the executor's activations)."""
    out = []
    for layout, g in zip(layouts, given):
        mark_layout(describe(layout))
        losses, inputs = [], []
        with one_thread():
            for step in range(STEPS):
                ids, targets = batch(step, rank_device())
                with trace() as t, around(fn):
                    loss = fn(g.stage, g.optimizer, ids, targets, g.mesh, layout.micro_batches, layout.schedule)
                losses.append(float(loss) if loss is not None else float("nan"))
                inputs.append([digest(ids), digest(targets)])        # the caller's, as the step left them
        out.append({"losses": losses, "stage": g.i_pp, "inputs": inputs, "trace": t,
                    "weights": {name: p.detach().to("cpu", copy=True) for name, p in g.stage.named_parameters()},
                    "expected": g.expected,
                    "model_states": model_state_bytes(list(g.stage.parameters()), g.optimizer)})
    return out
