"""Lab 11's checks (hiding communication behind computation): FSDP's prefetch, the all-gather + matmul
and matmul + reduce-scatter of asynchronous tensor parallelism decomposed into rings (Wang et al. 2023,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning Models"),
and the exposed communication read from a timeline. A test cell is a one-liner::

    checks.check_all_gather_matmul(all_gather_matmul)
    checks.check_all_gather_matmul(all_gather_matmul, hidden=True)
    checks.check_device(all_gather_matmul)     # no tensor made off the inputs' device

The distributed functions run in one launch of 4 ranks per call, cut into groups of t consecutive
ranks (t = 2 and 4 visible; 1 and 3 hidden). Each is graded on its result (against one process), on
its schedule as the trace recorded it (the communication a computation hides is posted before that
computation starts and waited for after it started: the check hands the function the computation,
``layer`` or ``mm``, and times every call) and on its bytes (one shard per unit or ring step, to the
ring's neighbours). ``exposed_time`` is judged in this process against
:func:`minidist.trace.timeline.exposed`. minidist's own overlap (``minidist.overlap``, FSDP's prefetch
in ``minidist.data_parallel``, the ring exchanges of ``minidist.collectives``, the timeline's
measures) is refused while a graded function runs. Cases and inputs are in ``cases.py``, the code that
runs the student's function in ``answers.py``, the comparisons in ``verdicts.py``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab11_overlap import answers, cases, verdicts
from minidist.checks.lab11_overlap.cases import DISTRIBUTED, GRADED, WORLD

__all__ = ["CHECKS", "GRADED", "REFUSED", "check_all_gather_matmul", "check_device", "check_exposed_time",
           "check_matmul_reduce_scatter", "check_prefetch_forward"]

REFUSED = Refusal("overlapping communication with computation",
                  ("minidist.overlap", "minidist.data_parallel", "minidist.collectives", "minidist.tensor_parallel",
                   "minidist.trace.timeline", "minidist.cost.overlap"), checks=__name__)

CHECKS = Registry(__name__, refusal=REFUSED)
FUNCTIONS = {name: CHECKS.check(name, partial(cases.function_cases, name), partial(answers.ANSWER[name], name),
                                verdicts.VERDICT[name], where="groups", world=WORLD, timeout=40.0,
                                covered=partial(cases.covered, name))
             for name in DISTRIBUTED}
FUNCTIONS["exposed_time"] = CHECKS.check("exposed_time", partial(cases.function_cases, "exposed_time"),
                                         answers.exposed, verdicts.exposed_verdict,
                                         covered=partial(cases.covered, "exposed_time"))
#: every distributed function makes buffers of its own (a gathered weight, a received chunk, the output)
DEVICE = CHECKS.devices(*(FUNCTIONS[name] for name in DISTRIBUTED))


@CHECKS.entry(FUNCTIONS["prefetch_forward"])
def check_prefetch_forward(fn, *, hidden: bool = False) -> None:
    """FSDP's forward prefetch: the output of every unit in turn, the next unit's all-gather posted before this
    unit computes and waited for after, one unit ahead, one all-gather of this rank's shard per unit."""


@CHECKS.entry(FUNCTIONS["all_gather_matmul"])
def check_all_gather_matmul(fn, *, hidden: bool = False) -> None:
    """all_gather(x_shard) Wᵀ as a ring: each next chunk's send and receive posted before this chunk's matmul,
    waited for after it; t - 1 shards around the ring."""


@CHECKS.entry(FUNCTIONS["matmul_reduce_scatter"])
def check_matmul_reduce_scatter(fn, *, hidden: bool = False) -> None:
    """reduce_scatter(x Wᵀ) as a ring: each accumulator sent before the next chunk's matmul, waited for after
    it; t - 1 output chunks around the ring."""


@CHECKS.entry(FUNCTIONS["exposed_time"])
def check_exposed_time(fn, *, hidden: bool = False) -> None:
    """The seconds a rank waited on communication, the union of its waits, from a trace's events."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``prefetch_forward``, ``all_gather_matmul`` or ``matmul_reduce_scatter`` (found by its
    name) live: its first visible case, run with torch's default device ``meta`` in every rank
    (kit/device_check.py). A tensor made without ``device=`` fails, naming its line."""
