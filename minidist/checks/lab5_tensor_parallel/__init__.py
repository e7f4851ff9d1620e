"""Lab 5's checks (tensor and sequence parallelism, Megatron-LM): each graded function against one
process, forward and backward, and its traced collectives against the cost model.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3: f, g, column/row-parallel layers, heads, vocab-parallel
loss); Korthikanti et al. 2022 (Sec. 4.2.2: sequence parallelism). A test cell is a one-liner::

    checks.check_column_parallel_linear(column_parallel_linear)
    checks.check_column_parallel_linear(column_parallel_linear, hidden=True)
    checks.check_device(sp_gather)     # no tensor made off the inputs' device

One launch of 4 ranks per call runs every case: the ranks are cut into tensor-parallel groups of t
consecutive ranks (t = 3 leaves rank 3 alone, a group of one; t = 4 passes ``group=None``, the
default group), so every function runs inside sub-groups. A case compares the output, the input
gradient and every parameter gradient with the single-process module (``minidist.models``, same
seed on every rank), and, for t > 1, the collectives traced in forward and in backward with
:mod:`minidist.cost.tensor_parallel` (kind and payload bytes, in any order). The lab's other
functions are stood in for by minidist's own inside the ranks (``STAND_INS``, :mod:`minidist.checks.kit.stand_ins`:
the notebook's names are rebound there), so a wrong f costs f's points, not those of every layer built on it;
minidist's implementation of the graded function itself is refused. The cases and inputs are in
``cases.py``, the code that runs the student's function in ``answers.py``, the references and
comparisons in ``verdicts.py``, the demo cells' ``measure`` in ``demo.py``.
"""
from __future__ import annotations

import importlib
import sys
from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.kit.stand_ins import StandIns
from minidist.checks.lab5_tensor_parallel import answers, cases, verdicts
from minidist.checks.lab5_tensor_parallel.cases import CFG, GRADED, SEQ, WORLD
from minidist.checks.lab5_tensor_parallel.demo import measure
from minidist.tensor_parallel.comm import copy_to_tp, gather_along_dim, reduce_from_tp, reduce_scatter_along_dim
from minidist.tensor_parallel.layers import column_parallel_linear, row_parallel_linear

__all__ = ["CFG", "CHECKS", "FUNCTIONS", "GRADED", "REFUSED", "STAND_INS", "check_column_parallel_linear",
           "check_copy_to_tp", "check_device", "check_reduce_from_tp", "check_row_parallel_linear", "check_sp_gather",
           "check_sp_mlp_block", "check_sp_reduce_scatter", "check_tp_attention", "check_tp_mlp",
           "check_vocab_parallel_cross_entropy", "measure"]


def sp_gather(x, group=None):
    """minidist's all-gather along the sequence dimension, as the lab's ``sp_gather``."""
    return gather_along_dim(x, SEQ, group)


def sp_reduce_scatter(x, group=None):
    """minidist's reduce-scatter along the sequence dimension, as the lab's ``sp_reduce_scatter``."""
    return reduce_scatter_along_dim(x, SEQ, group)


#: minidist.tensor_parallel is refused in graded code; shard_range (where chunk r of n starts and ends) is handed out.
REFUSED = Refusal("tensor and sequence parallelism", ("minidist.tensor_parallel",),
                  allow=("minidist.tensor_parallel.comm.shard_range",), checks=__name__)
# The lab's functions that other lab functions call, stood in for by minidist's own in every test but their
# own: (stand-in, minidist names it is, minidist names its backward needs). f's test refuses CopyToTP.
STAND_INS = StandIns({
    "copy_to_tp": (copy_to_tp, ("comm.copy_to_tp", "comm.CopyToTP")),
    "reduce_from_tp": (reduce_from_tp, ("comm.reduce_from_tp", "comm.ReduceFromTP")),
    "column_parallel_linear": (column_parallel_linear, ("layers.column_parallel_linear",), ("comm.CopyToTP",)),
    "row_parallel_linear": (row_parallel_linear, ("layers.row_parallel_linear",), ("comm.ReduceFromTP",)),
    "sp_gather": (sp_gather, ("comm.gather_along_dim", "comm.GatherAlongDim")),
    "sp_reduce_scatter": (sp_reduce_scatter, ("comm.reduce_scatter_along_dim", "comm.ReduceScatterAlongDim")),
}, prefix="minidist.tensor_parallel.")


def load_dynamo_before_the_ranks() -> None:
    """torch's functional collectives load ``torch._dynamo`` on their first call (seconds of CPU in every
    rank, past a launch's timeout on a busy machine): when the notebook has imported them it is loaded
    here once, before the ranks are forked, and they inherit it."""
    if "torch.distributed._functional_collectives" in sys.modules:
        importlib.import_module("torch._dynamo")


CHECKS = Registry(__name__, refusal=REFUSED)
FUNCTIONS = {name: CHECKS.check(name, partial(cases.function_cases, name), partial(answers.ANSWER[name], name),
                                verdicts.VERDICT[name], where="groups", world=WORLD,
                                refusal=STAND_INS.refusal(REFUSED, name), stand_ins=STAND_INS.rebound(name),
                                covered=partial(cases.covered, name), prepare=load_dynamo_before_the_ranks)
             for name in GRADED}
#: the functions that make buffers of their own (the device check costs a launch each)
DEVICE = CHECKS.devices(*(FUNCTIONS[name] for name in ("vocab_parallel_cross_entropy", "sp_gather",
                                                       "sp_reduce_scatter")))


@CHECKS.entry(FUNCTIONS["copy_to_tp"])
def check_copy_to_tp(fn, *, hidden: bool = False) -> None:
    """f: the identity forward, an all-reduce of the gradient backward (Megatron-LM, Sec. 3)."""


@CHECKS.entry(FUNCTIONS["reduce_from_tp"])
def check_reduce_from_tp(fn, *, hidden: bool = False) -> None:
    """g: an all-reduce forward, the identity backward (Megatron-LM, Sec. 3)."""


@CHECKS.entry(FUNCTIONS["column_parallel_linear"])
def check_column_parallel_linear(fn, *, hidden: bool = False) -> None:
    """The column-parallel linear layer: this rank's columns of the output, f on the input."""


@CHECKS.entry(FUNCTIONS["row_parallel_linear"])
def check_row_parallel_linear(fn, *, hidden: bool = False) -> None:
    """The row-parallel linear layer: the whole output, summed over the group by g."""


@CHECKS.entry(FUNCTIONS["tp_mlp"])
def check_tp_mlp(fn, *, hidden: bool = False) -> None:
    """The tensor-parallel MLP: one f before the column-parallel half, one g after the row-parallel half,
    called twice in a row on the same module."""


@CHECKS.entry(FUNCTIONS["tp_attention"])
def check_tp_attention(fn, *, hidden: bool = False) -> None:
    """Tensor-parallel attention, split by whole heads (GQA included): one f, one g; a ValueError before any
    message when the heads do not split; called twice in a row on the same module."""


@CHECKS.entry(FUNCTIONS["vocab_parallel_cross_entropy"])
def check_vocab_parallel_cross_entropy(fn, *, hidden: bool = False) -> None:
    """The cross-entropy of logits split over the vocabulary: the loss and this rank's logits' gradient,
    stable where exp overflows without the max, an uneven vocabulary and ignore_index included."""


@CHECKS.entry(FUNCTIONS["sp_gather"])
def check_sp_gather(fn, *, hidden: bool = False) -> None:
    """Sequence parallelism's all-gather along the sequence (a reduce-scatter backward)."""


@CHECKS.entry(FUNCTIONS["sp_reduce_scatter"])
def check_sp_reduce_scatter(fn, *, hidden: bool = False) -> None:
    """Sequence parallelism's reduce-scatter along the sequence (an all-gather backward)."""


@CHECKS.entry(FUNCTIONS["sp_mlp_block"])
def check_sp_mlp_block(fn, *, hidden: bool = False) -> None:
    """The sequence-parallel MLP block (Korthikanti et al. 2022, Sec. 4.2.2): LayerNorm on the sequence
    shard, an all-gather and a reduce-scatter, the replicated parameters' partial gradients all-reduced."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``vocab_parallel_cross_entropy``, ``sp_gather`` or ``sp_reduce_scatter`` (found by
    its name) live: its first visible case, run with torch's default device ``meta`` in every rank
    (kit/device_check.py). A tensor made without ``device=`` fails, naming its line: on a GPU node it would
    sit on the CPU next to CUDA tensors."""
