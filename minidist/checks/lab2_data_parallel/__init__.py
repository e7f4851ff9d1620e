"""Lab 2's checks (data parallelism, Li et al. 2020, *PyTorch Distributed*): ``split_batch``,
``average_gradients``, ``make_buckets`` and ``BucketedDDP``.

``split_batch`` and ``make_buckets`` run in this process; the others train on N ranks through the
one data-parallel loop (:mod:`minidist.checks.kit.training`) and are compared with single-process
training on the whole batch, with a rank-dependent model (a layer used on some ranks only, hooks
firing in another order), with the traced communication, and (``check_bucketed_ddp_overlap``) with
the moment backward produced its last gradient. A lab test cell is a one-liner::

    checks.check_average_gradients(average_gradients)
    checks.check_bucketed_ddp(BucketedDDP, hidden=True)
    checks.check_device(BucketedDDP)     # no tensor made off the gradients' device

Every rank trains on its contiguous slice of the same global batch (:func:`minidist.models.mlp_batch`).
A deadlock fails after the check's timeout with the launcher's diagnosis, prefixed with the case that
was running. The cases are in ``cases.py``, the code that runs the student's in ``answers.py``, the
comparisons in ``verdicts.py``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab2_data_parallel import answers, cases, verdicts

#: minidist's data parallelism (NaiveDDP, BucketedDDP, make_buckets, ...) is refused in graded code.
REFUSED = Refusal("data parallelism", ("minidist.data_parallel",), checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)
_ON_RANKS = dict(where="launch", world=lambda case: case[0])

SPLIT = CHECKS.check("split_batch", cases.split_cases, answers.split, verdicts.split, covered=cases.split_covered)
AVERAGE = CHECKS.check("average_gradients_equal", cases.average_cases,
                       partial(answers.trained_and_probed, kind="average_gradients"), verdicts.average,
                       function="average_gradients", covered=cases.average_covered, **_ON_RANKS)
AVERAGE_TRAFFIC = CHECKS.check("average_gradients_traffic", cases.average_traffic_cases,
                               partial(answers.trained_only, kind="average_gradients"), verdicts.average_traffic,
                               params=(), function="average_gradients", title="average_gradients traffic",
                               covered=cases.average_traffic_covered, **_ON_RANKS)
BUCKETS = CHECKS.check("make_buckets", cases.bucket_cases, answers.buckets, verdicts.buckets,
                       covered=cases.bucket_covered)
BUCKETED = CHECKS.check("bucketed_ddp_equal", cases.bucketed_cases, partial(answers.trained_and_probed,
                        kind="bucketed_ddp"), verdicts.bucketed, function="BucketedDDP", covered=cases.bucketed_covered,
                        **_ON_RANKS)
BUCKETED_TRAFFIC = CHECKS.check("bucketed_ddp_traffic", cases.bucketed_traffic_cases,
                                partial(answers.trained_only, kind="bucketed_ddp"), verdicts.bucketed_traffic,
                                params=(), function="BucketedDDP", title="BucketedDDP traffic",
                                covered=cases.bucketed_traffic_covered, **_ON_RANKS)
OVERLAP = CHECKS.check("bucketed_ddp_overlap", cases.overlap_cases, answers.overlap, verdicts.overlap, params=(),
                       function="BucketedDDP", title="BucketedDDP overlap", covered=cases.overlap_covered,
                       where="launch", world=lambda cap: 2)
DEVICE = CHECKS.devices(AVERAGE, BUCKETED)


@CHECKS.entry(SPLIT)
def check_split_batch(fn, *, hidden: bool = False) -> None:
    """``split_batch(x, y, rank, world_size)`` -> rank's contiguous block of x and of y;
    a batch that does not divide by world_size raises ValueError. Pure: no launch."""


@CHECKS.entry(AVERAGE)
def check_average_gradients(fn, *, hidden: bool = False) -> None:
    """Training with ``average_gradients(model)`` after every backward equals single-process
    training on the whole batch (SGD with momentum, 3 steps), and on the rank-dependent model
    every rank ends with the mean of the ranks' local gradients."""


@CHECKS.entry(AVERAGE_TRAFFIC)
def check_average_gradients_traffic(fn) -> None:
    """One all-reduce per trainable parameter, Ψ·4 bytes of payload in all, nothing else."""


@CHECKS.entry(BUCKETS)
def check_make_buckets(fn, *, hidden: bool = False) -> None:
    """Greedy buckets of at most ``cap_bytes``, in reverse parameter order; a tensor bigger
    than the cap gets a bucket of its own. Pure: no launch."""


@CHECKS.entry(BUCKETED)
def check_bucketed_ddp(fn, *, hidden: bool = False) -> None:
    """Training with ``BucketedDDP(model, bucket_cap_bytes)`` (``finish_gradient_sync()``
    after every backward) equals single-process training on the whole batch."""


@CHECKS.entry(BUCKETED_TRAFFIC)
def check_bucketed_ddp_traffic(fn) -> None:
    """Per step: one all-reduce per bucket (not per parameter), Ψ·4 bytes of payload in all."""


@CHECKS.entry(OVERLAP)
def check_bucketed_ddp_overlap(fn) -> None:
    """The first bucket's all-reduce starts from a gradient hook, before backward has
    produced its last gradient, and backward never waits for it: rank 0 produces its last
    gradient before rank 1 has started (``answers.overlap``), which only asynchronous
    all-reduces allow (communication overlaps the rest of backward)."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``average_gradients`` or ``BucketedDDP`` (found by its name) live: its first
    visible launch, run with torch's default device ``meta`` in every rank (kit/device_check.py). A tensor
    made without ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA
    tensors."""
