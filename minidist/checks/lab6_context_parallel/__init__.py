"""Lab 6's checks (context parallelism: DeepSpeed-Ulysses and ring attention): each graded function
against full attention in one process, and its traced communication against the cost model.

Jacobs et al. 2023 (DeepSpeed-Ulysses); Liu et al. 2023 (Ring Attention); Milakov & Gimelshein
2018 and Dao et al. 2022 (the log-sum-exp merge); Brandon et al. 2023 (load-balanced causal
shards). A test cell is a one-liner::

    checks.check_function("ring_attention_forward", ring_attention_forward)
    checks.check_function("ring_attention_forward", ring_attention_forward, hidden=True)
    checks.check_device("ring_attention_forward", ring_attention_forward)   # no tensor off the inputs' device

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
minidist's own inside the ranks (``STAND_INS``); minidist's implementation of the graded one is
refused. The cases and inputs are in ``cases.py``, the code that runs the student's function in
``answers.py``, the references and comparisons in ``verdicts.py``, the demo cells' ``measure`` in
``demo.py``; the notebook's demo of blocking sends uses ``blocking_p2p``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import Registry
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.lab6_context_parallel import answers, cases, verdicts
from minidist.checks.lab6_context_parallel.cases import B, CP_CHECK_TIMEOUT, D, GRADED, H, MERGE, WORLD
from minidist.checks.lab6_context_parallel.demo import measure
from minidist.context_parallel.all_to_all import all_to_all
from minidist.context_parallel.merge import merge_partial_attention
from minidist.runtime.strict_async import blocking_p2p

__all__ = ["B", "CHECKS", "D", "FUNCTIONS", "GRADED", "H", "REFUSED", "STAND_INS", "blocking_p2p", "check_device",
           "check_function", "measure"]

CP = "minidist.context_parallel."

# The lab's functions that another graded function calls, stood in for by minidist's own in every
# test but their own: (stand-in, minidist names it is). A test allows the other functions' names.
STAND_INS = {
    "all_to_all": (all_to_all, ("all_to_all.all_to_all", "all_to_all.AllToAll")),
    "merge_partial_attention": (merge_partial_attention, ("merge.merge_partial_attention",)),
}

#: minidist.context_parallel is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("context parallelism", ("minidist.context_parallel",), checks=__name__)


def refusal(name: str) -> Refusal:
    """What ``name``'s test refuses: minidist.context_parallel, but the other functions' stand-ins."""
    allow = tuple(CP + a for other, (_, names) in STAND_INS.items() if other != name for a in names)
    return Refusal(REFUSED.technique, REFUSED.modules, allow, REFUSED.checks)


def stand_ins(name: str, params: dict) -> dict:
    """The lab's other functions, rebound inside the ranks."""
    return {other: ref for other, (ref, _) in STAND_INS.items() if other != name}


CHECKS = Registry(__name__)


def graded_check(name: str):
    """The Check of graded function ``name``: the merge in this process, the others on groups of ranks."""
    if name == MERGE:
        return CHECKS.check(MERGE, cases.merge_cases, answers.merge, verdicts.merge, refusal=refusal(MERGE),
                            covered=partial(cases.covered, MERGE))
    return CHECKS.check(name, partial(cases.function_cases, name), answers.ANSWER[name], verdicts.VERDICT[name],
                        where="groups", world=WORLD, stop_at_first_failure=True, refusal=refusal(name),
                        stand_ins=partial(stand_ins, name), covered=partial(cases.covered, name))


FUNCTIONS = {name: graded_check(name) for name in GRADED}
#: the functions that make buffers of their own (the device check costs a launch each)
DEVICE = {name: on_meta(FUNCTIONS[name]) for name in ("all_to_all", "ring_attention_forward")}


@CHECKS.entry(FUNCTIONS, by="name")
def check_function(name: str, fn, hidden: bool = False, timeout: float = CP_CHECK_TIMEOUT) -> None:
    """Lab 6's graded function ``name``: on 4 ranks cut into groups of t (visible t = 2, 4; hidden
    1, 2, 3, 4), inputs on ``minidist.device()``, output (its dtype exactly) and gradients equal
    fp64 attention of the whole sequence on the CPU, the caller's tensors unchanged, communication
    equals the cost model; the merge in this process. The visible cases include each rule the text
    stresses: a ValueError before any message (a scatter dim, query heads, a sequence that does not
    split), the ring with every isend/irecv blocking, and with a late peer (its first block computed
    before the late message can land). Hidden cases: other dims, fp64 and bf16, GQA and MQA, scores
    far past exp's range, kv heads that do not split, more blocking runs, a late peer at t = 4, more
    sequences that do not cut into 2P chunks. Prints the ✓ line when it passes."""


@CHECKS.entry(DEVICE, by="name")
def check_device(name: str, fn, timeout: float = CP_CHECK_TIMEOUT) -> None:
    """Where the tensors of ``name`` live: its first visible case, run with torch's default device
    ``meta`` in every rank (kit/device_check.py). A tensor made without ``device=`` (a receive buffer)
    fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
