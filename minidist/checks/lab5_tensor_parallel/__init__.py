"""Lab 5's checks (tensor and sequence parallelism, Megatron-LM): each graded function against one
process, forward and backward, and its traced collectives against the cost model.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3: f, g, column/row-parallel layers, heads, vocab-parallel
loss); Korthikanti et al. 2022 (Sec. 4.2.2: sequence parallelism). A test cell is a one-liner::

    checks.check_function("column_parallel_linear", column_parallel_linear)
    checks.check_function("column_parallel_linear", column_parallel_linear, hidden=True)
    checks.check_device("sp_gather", sp_gather)     # no tensor made off the inputs' device

One launch of 4 ranks per call runs every case: the ranks are cut into tensor-parallel groups of t
consecutive ranks (t = 3 leaves rank 3 alone, a group of one; t = 4 passes ``group=None``, the
default group), so every function runs inside sub-groups. A case compares the output, the input
gradient and every parameter gradient with the single-process module (``minidist.models``, same
seed on every rank), and, for t > 1, the collectives traced in forward and in backward with
:mod:`minidist.cost.tensor_parallel` (kind and payload bytes, in any order). The lab's other
functions are stood in for by minidist's own inside the ranks (``STAND_INS``: the notebook's names
are rebound there), so a wrong f costs f's points, not those of every layer built on it;
minidist's implementation of the graded function itself is refused. The cases and inputs are in
``cases.py``, the code that runs the student's function in ``answers.py``, the references and
comparisons in ``verdicts.py``, the demo cells' ``measure`` in ``demo.py``.
"""
from __future__ import annotations

import importlib
import sys
from functools import partial

from minidist.checks.kit.check import Registry
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.lab5_tensor_parallel import answers, cases, verdicts
from minidist.checks.lab5_tensor_parallel.cases import CFG, GRADED, SEQ, TP_CHECK_TIMEOUT, WORLD
from minidist.checks.lab5_tensor_parallel.demo import measure
from minidist.tensor_parallel.comm import copy_to_tp, gather_along_dim, reduce_from_tp, reduce_scatter_along_dim
from minidist.tensor_parallel.layers import column_parallel_linear, row_parallel_linear

__all__ = ["CFG", "CHECKS", "FUNCTIONS", "GRADED", "REFUSED", "STAND_INS", "check_device", "check_function",
           "measure"]

TP = "minidist.tensor_parallel."


def sp_gather(x, group=None):
    """minidist's all-gather along the sequence dimension, as the lab's ``sp_gather``."""
    return gather_along_dim(x, SEQ, group)


def sp_reduce_scatter(x, group=None):
    """minidist's reduce-scatter along the sequence dimension, as the lab's ``sp_reduce_scatter``."""
    return reduce_scatter_along_dim(x, SEQ, group)


# The lab's functions that other lab functions call, stood in for by minidist's own in every
# test but their own: (stand-in, minidist names it is, minidist names its backward needs).
# A test allows the other functions' names, never its own function's (f's test refuses CopyToTP).
STAND_INS = {
    "copy_to_tp": (copy_to_tp, ("comm.copy_to_tp", "comm.CopyToTP"), ()),
    "reduce_from_tp": (reduce_from_tp, ("comm.reduce_from_tp", "comm.ReduceFromTP"), ()),
    "column_parallel_linear": (column_parallel_linear, ("layers.column_parallel_linear",), ("comm.CopyToTP",)),
    "row_parallel_linear": (row_parallel_linear, ("layers.row_parallel_linear",), ("comm.ReduceFromTP",)),
    "sp_gather": (sp_gather, ("comm.gather_along_dim", "comm.GatherAlongDim"), ()),
    "sp_reduce_scatter": (sp_reduce_scatter, ("comm.reduce_scatter_along_dim", "comm.ReduceScatterAlongDim"), ()),
}

#: minidist.tensor_parallel is refused in graded code; shard_range (where chunk r of n starts and ends) is handed out.
REFUSED = Refusal("tensor and sequence parallelism", ("minidist.tensor_parallel",),
                  allow=(TP + "comm.shard_range",), checks=__name__)


def refusal(name: str) -> Refusal:
    """What ``name``'s test refuses: minidist.tensor_parallel, but the other functions' stand-ins (and
    what their backward needs) unless they are ``name``'s own minidist code."""
    own = set(STAND_INS[name][1]) if name in STAND_INS else set()
    allow = [TP + a for other, (_, names, needs) in STAND_INS.items() if other != name
             for a in names + needs if a not in own]
    return Refusal(REFUSED.technique, REFUSED.modules, REFUSED.allow + tuple(dict.fromkeys(allow)), REFUSED.checks)


def stand_ins(name: str, params: dict) -> dict:
    """The lab's other functions, rebound inside the ranks."""
    return {other: ref for other, (ref, _, _) in STAND_INS.items() if other != name}


def load_dynamo_before_the_ranks() -> None:
    """torch's functional collectives load ``torch._dynamo`` on their first call (seconds of CPU in every
    rank, past a launch's timeout on a busy machine): when the notebook has imported them it is loaded
    here once, before the ranks are forked, and they inherit it."""
    if "torch.distributed._functional_collectives" in sys.modules:
        importlib.import_module("torch._dynamo")


CHECKS = Registry(__name__)
FUNCTIONS = {name: CHECKS.check(name, partial(cases.function_cases, name), partial(answers.ANSWER[name], name),
                                partial(verdicts.VERDICT[name], name), where="groups", world=WORLD,
                                refusal=refusal(name), stand_ins=partial(stand_ins, name),
                                covered=partial(cases.covered, name), prepare=load_dynamo_before_the_ranks)
             for name in GRADED}
#: the functions that make buffers of their own (the device check costs a launch each)
DEVICE = {name: on_meta(FUNCTIONS[name]) for name in ("vocab_parallel_cross_entropy", "sp_gather", "sp_reduce_scatter")}


@CHECKS.entry(FUNCTIONS, by="name")
def check_function(name: str, fn, hidden: bool = False, timeout: float = TP_CHECK_TIMEOUT) -> None:
    """Lab 5's graded function ``name`` on 4 ranks cut into groups of t: output, input and
    parameter gradients equal one process; collectives (t > 1) equal the cost model's; the
    caller's tensors unchanged; outputs in the inputs' dtype; a module used twice in a row.
    Visible: t = 2 and 4; hidden: t = 1, 2, 3, 4 and the cases the lab states (no bias,
    2-D and odd shapes, fp64 and bf16, an uneven vocabulary, a custom ignore_index, logits that
    overflow exp without the max, GQA, query or kv heads that do not split)."""


@CHECKS.entry(DEVICE, by="name")
def check_device(name: str, fn, timeout: float = TP_CHECK_TIMEOUT) -> None:
    """Where the tensors of ``name`` live: its first visible case, run with torch's default device
    ``meta`` in every rank (kit/device_check.py). A tensor made without ``device=`` fails, naming its
    line: on a GPU node it would sit on the CPU next to CUDA tensors."""
