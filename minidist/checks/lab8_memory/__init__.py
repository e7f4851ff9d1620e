"""Lab 8's checks (memory beyond sharding: mixed precision with a dynamic loss scale, ZeRO-1 in
mixed precision, activation recomputation): each graded function against an fp32 reference.

Micikevicius et al. 2018 (mixed precision training, loss scaling); Rajbhandari et al. 2019 (ZeRO:
2 + 2 + 12 bytes per parameter with Adam, 2 + 2 + 12/N with ZeRO-1); Chen et al. 2016 and
Korthikanti et al. 2022 (full and selective recomputation). A lab test cell is a one-liner::

    checks.check_zero1_mixed_precision_step(zero1_mixed_precision_step)
    checks.check_zero1_mixed_precision_step(zero1_mixed_precision_step, hidden=True)
    checks.check_device(DynamicLossScaler)     # no tensor made off the gradients' device

The distributed functions run in one launch of 4 ranks per call, cut into data-parallel groups of
t consecutive ranks (visible t = 2, 4; hidden 1–4; t = 3 runs next to a group of one). The steps
train a 43-parameter MLP (uneven shards over 2, 3 and 4 ranks) for two or three steps: the
master weights must equal an fp32 shadow fed with every rank's actual gradients, the model's
weights must be the masters cast back, the loss scale must follow the reference, the gradients
must be freed, and with Adam the model-state bytes each rank holds
(:func:`minidist.memory.model_state_bytes`) must be 2 + 2 + 12 (or 12/N) per parameter before the
step and 2 + 12 after it. Hidden: an overflow injected in one rank's gradient only (every rank
skips, the scale backs off, the next step recovers), bf16 without a scaler, mixed precision
against fp32 training in one process within ``cases.VS_FP32``, masters that do not fit
(``ValueError`` before any collective). ``DynamicLossScaler`` is checked in two parts: its
bookkeeping in this process, ``unscale_`` on the ranks. ``recompute_blocks`` has no communication
and is checked in this process: output, input and parameter gradients equal the blocks run
plainly with the same random state, the random state afterwards is the same too, the caller's
input and weights are untouched, and the bytes saved for backward
(:class:`minidist.memory.ActivationMeter`) equal :func:`verdicts.expected_saved` to the byte.
minidist's own implementation (``minidist.memory_techniques``) is refused while a graded function
runs. The cases are in ``cases.py``, the code that runs the student's functions in ``answers.py``,
the comparisons in ``verdicts.py``, the demo cells' measurements in ``demo.py`` (docs/AUTHORING.md).
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab8_memory import answers, cases, verdicts
from minidist.checks.lab8_memory.demo import measure_bytes, measure_recompute
from minidist.runtime import import_optimizers_before_fork

import_optimizers_before_fork()      # the ranks build optimizers: they inherit the import

__all__ = ["CHECKS", "REFUSED", "check_device", "check_dynamic_loss_scaler", "check_mixed_precision_step",
           "check_recompute_blocks", "check_zero1_mixed_precision_step", "measure_bytes", "measure_recompute"]

#: minidist.memory_techniques is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("mixed precision, loss scaling and recomputation", ("minidist.memory_techniques",),
                  checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)
_ON_RANKS = dict(where="groups", world=cases.WORLD)

SCALER_HERE = CHECKS.check("DynamicLossScaler", cases.scaler_cases, answers.scaler, verdicts.scaler)
SCALER_RANKS = CHECKS.check("DynamicLossScaler unscale_", cases.unscale_cases, answers.unscale, verdicts.unscale,
                            function="DynamicLossScaler", covered=partial(cases.covered, "DynamicLossScaler"),
                            **_ON_RANKS)
STEP = CHECKS.check("mixed_precision_step", cases.step_cases, partial(answers.step, sharded=False), verdicts.step,
                    covered=partial(cases.covered, "mixed_precision_step"), **_ON_RANKS)
ZERO1_STEP = CHECKS.check("zero1_mixed_precision_step", cases.step_cases, partial(answers.step, sharded=True),
                          verdicts.zero1_step, covered=partial(cases.covered, "zero1_mixed_precision_step"),
                          **_ON_RANKS)
RECOMPUTE = CHECKS.check("recompute_blocks", cases.recompute_cases, answers.recompute, verdicts.recompute,
                         covered=partial(cases.covered, "recompute_blocks"))
#: the functions that make tensors of their own: the scaler's flag, ZeRO-1's padded buffers
DEVICE = CHECKS.devices(SCALER_RANKS, ZERO1_STEP)


@CHECKS.entry((SCALER_HERE, SCALER_RANKS))
def check_dynamic_loss_scaler(fn, *, hidden: bool = False) -> None:
    """``DynamicLossScaler``: its bookkeeping in this process (the scale's start, ``scale(loss)``, the
    history of ``update``, bad arguments refused), then ``unscale_`` on 4 ranks cut into groups of t
    (visible t = 2, 4; hidden 1–4): gradients divided in place, found_inf agreed with one all-reduce."""


@CHECKS.entry(STEP)
def check_mixed_precision_step(fn, *, hidden: bool = False) -> None:
    """The mixed-precision step on 4 ranks cut into groups of t: the fp32 master weights equal a shadow fed
    with every rank's gradients, the model's weights are the masters cast back, the loss scale follows the
    reference, the gradients are freed, 2 + 2 + 12 bytes per parameter with Adam."""


@CHECKS.entry(ZERO1_STEP)
def check_zero1_mixed_precision_step(fn, *, hidden: bool = False) -> None:
    """ZeRO-1 in mixed precision on 4 ranks cut into groups of t: this rank's shard of the master weights
    equals the shadow's, the model's weights are all the shards all-gathered and cast, 2 + 2 + 12/N bytes
    per parameter with Adam."""


@CHECKS.entry(RECOMPUTE)
def check_recompute_blocks(fn, *, hidden: bool = False) -> None:
    """Activation recomputation, in this process: output and gradients equal the blocks run plainly with the
    same random state, the random state afterwards too, the caller's input and weights untouched, and the
    bytes saved for backward what the policy keeps, to the byte."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``DynamicLossScaler`` (its ``unscale_``) or ``zero1_mixed_precision_step`` (found
    by its name) live: its first visible case on ranks, run with torch's default device ``meta`` in every
    rank (kit/device_check.py). A tensor made without ``device=`` fails, naming its line: on a GPU node it
    would sit on the CPU next to CUDA tensors."""
