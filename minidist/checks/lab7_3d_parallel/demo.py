"""Lab 7's measurements for the notebook's demo cells (not graded): the student's 3D step on 8 ranks,
per layout and rank its losses' error against one process, its traced bytes by axis, the model
states it holds and the executor's activation peak, next to the cost model (:func:`measure`).

The runs are the check's (:func:`minidist.checks.lab7_3d_parallel.answers.steps`), without the
refusal; the activation peak is read by wrapping the notebook's ``run_schedule`` (its global name)
around each call of the step, so that its ``peak_activation_bytes`` (the executor's
``ActivationMeter``) is recorded.
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch.distributed as dist

from minidist.checks.kit.launch import launch_named, mark_case
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.lab7_3d_parallel import answers
from minidist.checks.lab7_3d_parallel.cases import (BATCH, CFG, OPTIMIZER, STEP_TIMEOUT, STEP_LAYOUTS, STEPS,
                                                    WORLD, MemoryConfig, one_process, setup)
from minidist.checks.lab7_3d_parallel.verdicts import expected_memory, traffic_by_axis
from minidist.harness.parallel3d import Layout

#: measured after the visible layouts: a deeper pipeline, m = 4 micro-batches over 4 stages
DEEPER = Layout(2, 4, 1, "1f1b", 4)


@passes_quietly
def measure(train_step_3d, layouts=None, timeout: float = STEP_TIMEOUT) -> list[dict]:
    """One 8-rank launch of your step on ``layouts`` (default: the visible ones and
    2×4×1 1F1B): per layout and rank, the losses' error vs one process, the traced bytes by
    axis, the model states held after the step (``minidist.memory.model_state_bytes``) and the
    activation peak the executor measured (``ActivationMeter``), with the cost model's numbers."""
    layouts = list(layouts or STEP_LAYOUTS + [DEEPER])
    ref_losses, ref_state = one_process()
    out = launch_named(_measured, WORLD, train_step_3d, layouts, name="measure", timeout=timeout,
                       reference=partial(_setup, state=ref_state))
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


def _setup(progress, fn, layouts, state):
    return setup((WORLD, layouts), state)


def _measured(progress, fn, layouts, reference):
    """Inside a rank: the check's steps, with the activation peak and the traffic by axis of each layout."""
    peaks = _ActivationPeaks()
    rows = answers.steps(fn, layouts, reference, lambda text: mark_case(progress, text), around=peaks)
    for i, (layout, row) in enumerate(zip(layouts, rows)):
        recorded = [b for call in peaks.calls[i * STEPS:(i + 1) * STEPS] for b in call]
        row.update(activations=recorded[-1] if recorded else None,
                   traffic=traffic_by_axis(row.pop("trace").comm(), dist.get_rank(), layout))
        del row["weights"], row["expected"]          # what the check compares: not measured here
    return rows


class _ActivationPeaks:
    """Per call of the step, the ``peak_activation_bytes`` of every ``run_schedule`` it made: the
    notebook's global ``run_schedule`` is wrapped while the call runs (a step that does not call it
    by that name records nothing)."""

    def __init__(self):
        self.calls: list[list[int]] = []

    @contextlib.contextmanager
    def __call__(self, fn):
        self.calls.append([])
        names = getattr(fn, "__globals__", None)
        if names is None or "run_schedule" not in names:
            yield
            return
        inner, sink = names["run_schedule"], self.calls[-1]

        def recorded(*args, **kwargs):
            stats = inner(*args, **kwargs)
            sink.append(stats.peak_activation_bytes)
            return stats
        names["run_schedule"] = recorded
        try:
            yield
        finally:
            names["run_schedule"] = inner
