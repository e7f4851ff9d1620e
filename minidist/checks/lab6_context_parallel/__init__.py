"""Lab 6's checks (context parallelism: DeepSpeed-Ulysses and ring attention): each graded function
against full attention in one process, and its traced communication against the cost model.

Jacobs et al. 2023 (DeepSpeed-Ulysses); Liu et al. 2023 (Ring Attention); Milakov & Gimelshein
2018 and Dao et al. 2022 (the log-sum-exp merge); Brandon et al. 2023 (load-balanced causal
shards). A test cell is a one-liner::

    checks.check_ring_attention_forward(ring_attention_forward)
    checks.check_ring_attention_forward(ring_attention_forward, hidden=True)
    checks.check_device(ring_attention_forward)   # no tensor off the inputs' device

One launch of 4 ranks per call runs every case, and stops at the first case that fails: the ranks
are cut into context-parallel groups of t consecutive ranks (t = 3 leaves rank 3 alone, a group of
one; t = 4 is ``group=None``). A case builds its inputs on the CPU, hands them to the student's
code on ``minidist.device()``, and compares this rank's output (its dtype exactly; and, where the
function is differentiable, its input gradients) on the CPU with fp64 attention of the whole
sequence; the caller's tensors must come back unchanged; for t > 1 the traced communication with
:mod:`minidist.cost.context_parallel`: Ulysses' all-to-alls (kind and bytes; q, k, v packed into
fewer calls accepted), the ring's K/V passes (to the next rank only, from the previous only, P−1
blocks; any deadlock-free order, checked with every isend/irecv made blocking; and, with one peer
starting late, the first block computed before that peer's message can land: the pass overlaps
the compute). ``merge_partial_attention`` has no communication and is checked in this process, on
inputs whose exp overflows without the max. The lab's other functions are stood in for by
minidist's own inside the ranks (``STAND_INS``, :mod:`minidist.checks.kit.stand_ins`); minidist's
implementation of the graded one is refused. The cases and inputs are in ``cases.py``, the code that runs the student's function in
``answers.py``, the references and comparisons in ``verdicts.py``, the demo cells' ``measure`` in
``demo.py``; the notebook's demo of blocking sends uses ``blocking_p2p``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.kit.stand_ins import StandIns
from minidist.checks.lab6_context_parallel import answers, cases, verdicts
from minidist.checks.lab6_context_parallel.cases import B, D, GRADED, H, MERGE, WORLD
from minidist.checks.lab6_context_parallel.demo import measure
from minidist.context_parallel.all_to_all import all_to_all
from minidist.context_parallel.merge import merge_partial_attention
from minidist.runtime.strict_async import blocking_p2p

__all__ = ["B", "CHECKS", "D", "FUNCTIONS", "GRADED", "H", "REFUSED", "STAND_INS", "blocking_p2p", "check_all_to_all",
           "check_device", "check_merge_partial_attention", "check_ring_attention_forward", "check_ulysses_attention",
           "check_zigzag_shard", "measure"]

#: minidist.context_parallel is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("context parallelism", ("minidist.context_parallel",), checks=__name__)
# The lab's functions that another graded function calls, stood in for by minidist's own in every
# test but their own: (stand-in, minidist names it is). A test allows the other functions' names.
STAND_INS = StandIns({
    "all_to_all": (all_to_all, ("all_to_all.all_to_all", "all_to_all.AllToAll")),
    "merge_partial_attention": (merge_partial_attention, ("merge.merge_partial_attention",)),
}, prefix="minidist.context_parallel.")
CHECKS = Registry(__name__, refusal=REFUSED)


def graded_check(name: str):
    """The Check of graded function ``name``: the merge in this process, the others on groups of ranks."""
    if name == MERGE:
        return CHECKS.check(MERGE, cases.merge_cases, answers.merge, verdicts.merge,
                            refusal=STAND_INS.refusal(REFUSED, MERGE), covered=partial(cases.covered, MERGE))
    return CHECKS.check(name, partial(cases.function_cases, name), answers.ANSWER[name], verdicts.VERDICT[name],
                        where="groups", world=WORLD, stop_at_first_failure=True,
                        refusal=STAND_INS.refusal(REFUSED, name), stand_ins=STAND_INS.rebound(name),
                        covered=partial(cases.covered, name))


FUNCTIONS = {name: graded_check(name) for name in GRADED}
#: the functions that make buffers of their own (the device check costs a launch each)
DEVICE = CHECKS.devices(FUNCTIONS["all_to_all"], FUNCTIONS["ring_attention_forward"])


@CHECKS.entry(FUNCTIONS["all_to_all"])
def check_all_to_all(fn, *, hidden: bool = False) -> None:
    """The all-to-all that moves a scatter dimension's chunks to the ranks and gathers another; a
    ValueError before any message when the scatter dimension does not split."""


@CHECKS.entry(FUNCTIONS["ulysses_attention"])
def check_ulysses_attention(fn, *, hidden: bool = False) -> None:
    """DeepSpeed-Ulysses attention: all-to-alls to whole heads and back (q, k, v packed into fewer calls
    accepted); GQA and MQA; a ValueError before any message when the heads do not split."""


@CHECKS.entry(FUNCTIONS["merge_partial_attention"])
def check_merge_partial_attention(fn, *, hidden: bool = False) -> None:
    """The log-sum-exp merge of two partial attentions, in this process, on inputs whose exp overflows
    without the max."""


@CHECKS.entry(FUNCTIONS["ring_attention_forward"])
def check_ring_attention_forward(fn, *, hidden: bool = False) -> None:
    """Ring attention: K/V passed to the next rank only, P−1 blocks; every isend/irecv made blocking, and
    with a late peer, the first block computed before the late message can land."""


@CHECKS.entry(FUNCTIONS["zigzag_shard"])
def check_zigzag_shard(fn, *, hidden: bool = False) -> None:
    """The load-balanced causal shard: chunks r and 2P−1−r of 2P, no communication; a ValueError when the
    sequence does not cut into 2P chunks."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``all_to_all`` or ``ring_attention_forward`` (found by its name) live: its first
    visible case, run with torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made
    without ``device=`` (a receive buffer) fails, naming its line: on a GPU node it would sit on the CPU next
    to CUDA tensors."""
