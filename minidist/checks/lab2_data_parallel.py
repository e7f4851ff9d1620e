"""Lab 2's checks (data parallelism): split_batch, average_gradients, make_buckets, BucketedDDP.

One call runs a student's function or class on N ranks, trains with it through the one
data-parallel loop (:mod:`minidist.checks.kit.training`), compares with single-process training
and with the traced communication, and raises ``AssertionError`` saying in words what is
wrong. A lab test cell is a one-liner::

    checks.check_average_gradients(average_gradients)
    checks.check_bucketed_ddp(BucketedDDP, hidden=True)

Equality runs use SGD with momentum: Adam divides by the gradient's own scale, so it
would not notice a gradient that was summed instead of averaged. Every rank trains on its
contiguous slice of the same global batch (:func:`minidist.models.mlp_batch`). A deadlock
fails after ``timeout`` seconds with the launcher's diagnosis, prefixed with the case that
was running.
"""
from __future__ import annotations

import math

import torch

from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT, launch_named, report_passed
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, from_raising, judged, outcome
from minidist.checks.kit.returned import require_plain
from minidist.checks.lab2_cases import check_rank_dependent, overlap_probe, overlapped, rank_dependent_grads
from minidist.checks.lab2_traffic import average_traffic, bucketed_traffic
from minidist.checks.kit.training import _train_body, check_equal
from minidist.checks.kit.quiet import passes_quietly
from minidist.models import TINY_MLP_VARIANTS as MODELS

#: minidist's data parallelism (NaiveDDP, BucketedDDP, make_buckets, ...) is refused in graded code.
REFUSED = Refusal("data parallelism", ("minidist.data_parallel",), checks=__name__)


def _cases(models, cap=None, steps=3, batch=24):
    return [dict(model_kwargs=MODELS[m], steps=steps, batch=batch, cap=cap) for m in models]


def _train_and_probe(progress, cases, kind, impl):
    """The training cases, then the rank-dependent model (lab2_cases), in the same launch."""
    return _train_body(progress, cases, kind, impl), rank_dependent_grads(progress, kind, impl)


def _trained(name):
    """The comparison of a run (n, cases) of ``_train_and_probe``: training equals one process, the
    rank-dependent model's gradients are the mean. Judged (minidist.checks.kit.docket): the child files
    every rank's results; the grader's judge compares them again."""
    def compare(run, out):
        n, cases = run
        check_equal(name, n, cases, [o[0] for o in out])
        check_rank_dependent(name, n, [o[1] for o in out])
    return compare


def _launched(judged_check, params, body, kind, impl, name, timeout, *extra):
    """Every run (n, cases) of a judged check launched on n ranks: results filed and compared."""
    judged_check.run(params, lambda run: launch_named(body, run[0], run[1], kind, impl, *extra, name=name,
                                                      timeout=timeout, refuse=REFUSED))


# ----------------------------------------------------------------------------- lab 2: split
# Judged (minidist.checks.kit.docket): what split_batch gave goes as plain data to a verdict that makes
# the batch again from the case, here and in the grader's judge alike.
def _split_cases(hidden: bool) -> list[tuple]:
    sizes = [(12, 2), (12, 3), (12, 4)] + ([(24, 4), (5, 5), (7, 1), (30, 6)] if hidden else [])
    # hidden: feature counts that make x.numel() and y.numel() divisible by world_size when the
    # batch is not (a check on the wrong quantity passes the visible case only)
    bad = [(10, 4, 3)] + ([(6, 4, 2), (7, 2, 2), (3, 4, 4), (9, 6, 2)] if hidden else [])
    return [("split", batch, n) for batch, n in sizes] + [("bad", batch, n, d) for batch, n, d in bad]


def _split_batch_inputs(case):
    if case[0] == "bad":
        _, batch, n, d = case
        return torch.zeros(batch, d), torch.zeros(batch, 2 * d)
    batch = case[1]
    return torch.arange(batch * 3.0).view(batch, 3), torch.arange(batch * 2.0).view(batch, 2) + 1000


def _split_answer(split_batch, case):
    x, y = _split_batch_inputs(case)
    if case[0] == "bad":
        return outcome(lambda: graded_call(REFUSED, "split_batch", split_batch, x, y, 0, case[2]))
    answers = []
    for r in range(case[2]):
        got = graded_call(REFUSED, "split_batch", split_batch, x, y, r, case[2])
        require_plain(f"split_batch(batch={case[1]}, rank={r}, world_size={case[2]})", got)
        answers.append({"got": got, "x": x.clone(), "y": y.clone()})
    return answers


def _split_verdict(case, answer) -> str | None:
    x, y = _split_batch_inputs(case)
    if case[0] == "bad":
        if answer.get("raised") == "ValueError":
            return None
        return (f"split_batch(x of shape {tuple(x.shape)}, world_size={case[2]}) must raise ValueError: {case[1]} rows "
                f"do not split evenly into {case[2]} ranks (silently dropping rows changes the loss)")
    _, batch, n = case
    xs = []
    for r, seen in enumerate(answer):
        call, got = f"split_batch(batch={batch}, rank={r}, world_size={n})", seen["got"]
        if not (torch.equal(seen["x"], x) and torch.equal(seen["y"], y)):
            return f"{call} changed the caller's x or y; return slices (views) of them and leave the batch as it was"
        if not (isinstance(got, tuple) and len(got) == 2):
            return f"{call} must return a tuple (x_local, y_local), got {type(got).__name__}"
        for what, t, full in (("x", got[0], x), ("y", got[1], y)):
            if not isinstance(t, torch.Tensor) or t.shape != (batch // n, full.shape[1]):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                return (f"split_batch(batch={batch}, rank={r}, world_size={n}): {what}_local has shape {shape}; "
                        f"expected {(batch // n, full.shape[1])} (batch / world_size rows)")
        want = slice(r * (batch // n), (r + 1) * (batch // n))
        if not (torch.equal(got[0], x[want]) and torch.equal(got[1], y[want])):
            rows = [int(v) for v in (got[0][:, 0] / 3).tolist()]
            return (f"{call}: rank {r} got rows {rows} of x; expected the contiguous block "
                    f"{list(range(want.start, want.stop))} (and the same rows of y)")
        xs.append(got[0])
    if not torch.equal(torch.cat(xs), x):
        return f"split_batch(batch={batch}, world_size={n}): the ranks' slices together are not the batch"
    return None


JUDGED_SPLIT = Judged(__name__, "split_batch", _split_cases, _split_verdict)


@judged(JUDGED_SPLIT)
@passes_quietly
def check_split_batch(split_batch, hidden: bool = False) -> None:
    """``split_batch(x, y, rank, world_size)`` -> rank's contiguous block of x and of y;
    a batch that does not divide by world_size raises ValueError. Pure: no launch."""
    cases = JUDGED_SPLIT.cases(hidden=hidden)
    for i, case in enumerate(cases):
        JUDGED_SPLIT.require(dict(hidden=hidden), i, case, _split_answer(split_batch, case))
    report_passed("split_batch", f"{sum(c[0] == 'split' for c in cases)} (batch, world size) pairs: each rank's "
                                 f"contiguous rows, inputs unchanged; ValueError when rows do not split", hidden)


# ----------------------------------------------------------------------------- lab 2: naive DDP
def _average_runs(hidden: bool) -> list[tuple]:
    return [(n, _cases(list(MODELS) if hidden else ["plain", "frozen"])) for n in ((3, 4) if hidden else (2,))]


JUDGED_AVERAGE = Judged(__name__, "average_gradients", _average_runs, from_raising(_trained("average_gradients")))


@judged(JUDGED_AVERAGE)
@passes_quietly
def check_average_gradients(average_gradients, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Training with ``average_gradients(model)`` after every backward equals single-process
    training on the whole batch (SGD with momentum, 3 steps)."""
    sizes = (3, 4) if hidden else (2,)
    models = list(MODELS) if hidden else ["plain", "frozen"]
    _launched(JUDGED_AVERAGE, dict(hidden=hidden), _train_and_probe, "average_gradients", average_gradients,
              "average_gradients", timeout)
    report_passed("average_gradients", f"N={', '.join(map(str, sizes))}, models {', '.join(models)}: parameters vs "
                                       f"one process on the whole batch, a rank-dependent model", hidden)


JUDGED_AVERAGE_TRAFFIC = Judged(__name__, "average_gradients traffic",
                                lambda: [(n, _cases(["frozen", "tied"])) for n in (2, 3)],
                                from_raising(average_traffic), params=())


@judged(JUDGED_AVERAGE_TRAFFIC)
@passes_quietly
def check_average_gradients_traffic(average_gradients, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """One all-reduce per trainable parameter, Ψ·4 bytes of payload in all, nothing else."""
    _launched(JUDGED_AVERAGE_TRAFFIC, {}, _train_body, "average_gradients", average_gradients, "average_gradients",
              timeout)
    report_passed("average_gradients traffic", "N=2, 3: one all-reduce per trainable parameter, Ψ·4 bytes")


# ----------------------------------------------------------------------------- lab 2: buckets
#: the make_buckets cases' shapes; hidden cases also in fp64 and bf16 (one dtype per model: a
#: bucket is one flat buffer, so a real model with mixed dtypes also splits buckets where the dtype changes)
_SHAPES = [(13, 6), (13,), (13, 13), (13,), (13, 13), (13,), (5, 13), (5,)]


def _expected_buckets(sizes, cap):
    out, cur, size = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and size + sizes[i] > cap:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += sizes[i]
    return out + ([cur] if cur else [])


def _bucket_cases(hidden: bool) -> list[tuple]:
    fp32, fp64, bf16 = ([dt] * len(_SHAPES) for dt in (torch.float32, torch.float64, torch.bfloat16))
    configs = [(_SHAPES, fp32, 700), (_SHAPES, fp32, 2000)]
    if hidden:
        configs += [(_SHAPES, fp32, 4), (_SHAPES, fp32, 10 ** 6), (_SHAPES, fp32, 676), (_SHAPES, fp32, 728),
                    ([(3,)], fp32[:1], 12), ([(100,), (1,), (1,)], fp32[:3], 8),
                    (_SHAPES, fp64, 700), (_SHAPES, fp64, 2704), (_SHAPES, bf16, 400), (_SHAPES, bf16, 338)]
    return configs


def _bucket_params(case) -> list:
    shapes, dtypes, _ = case
    return [torch.nn.Parameter(torch.arange(math.prod(s), dtype=dt).view(s)) for s, dt in zip(shapes, dtypes)]


def _bucket_answer(make_buckets, case) -> dict:
    """The buckets as indices of the parameters given (what was returned, if it is not that), and
    the parameters' values after the call."""
    params = _bucket_params(case)
    idx = {id(p): i for i, p in enumerate(params)}      # before the call: it may reorder its argument
    got = graded_call(REFUSED, "make_buckets", make_buckets, params, case[2])
    require_plain(f"make_buckets(cap_bytes={case[2]})", got)
    try:
        indices = [[idx[id(p)] for p in b] for b in got]
    except (KeyError, TypeError):
        indices = f"{got!r:.200}"
    return {"buckets": indices, "after": [p.detach() for p in sorted(params, key=lambda p: idx[id(p)])]}


def _bucket_verdict(case, answer) -> str | None:
    shapes, dtypes, cap = case
    params = _bucket_params(case)
    sizes = [p.numel() * p.element_size() for p in params]
    if len(answer["after"]) != len(params) or not all(torch.equal(a, p.detach()) for a, p in zip(answer["after"], params)):
        return f"make_buckets(cap_bytes={cap}) changed the values of the parameters it was given; it only groups them"
    got = answer["buckets"]
    if isinstance(got, str):
        return f"make_buckets(cap_bytes={cap}) must return a list of lists of the given parameters, got {got}"
    want = _expected_buckets(sizes, cap)
    # the contract fixes the buckets and their order, not the order inside a bucket
    if [sorted(b) for b in got] != [sorted(b) for b in want] or sum(map(len, got)) != len(params):
        kinds = sorted({str(dt).replace("torch.", "") for dt in dtypes})
        return (f"make_buckets(params of {sizes} bytes ({'/'.join(kinds)}), cap_bytes={cap}): got buckets (as "
                f"parameter indices) {got}; expected {want} (any order inside a bucket). Buckets are filled "
                f"greedily in REVERSE order (the order backward produces gradients), a bucket holds at most "
                f"cap_bytes unless one tensor alone is bigger (a parameter's bytes: numel() * element_size()), "
                f"and every parameter appears exactly once.")
    return None


JUDGED_BUCKETS = Judged(__name__, "make_buckets", _bucket_cases, _bucket_verdict)


@judged(JUDGED_BUCKETS)
@passes_quietly
def check_make_buckets(make_buckets, hidden: bool = False) -> None:
    """Greedy buckets of at most ``cap_bytes``, in reverse parameter order; a tensor bigger
    than the cap gets a bucket of its own. Pure: no launch."""
    cases = JUDGED_BUCKETS.cases(hidden=hidden)
    for i, case in enumerate(cases):
        JUDGED_BUCKETS.require(dict(hidden=hidden), i, case, _bucket_answer(make_buckets, case))
    report_passed("make_buckets", f"{len(cases)} caps" + (" in fp32/fp64/bf16" if hidden else " in fp32")
                  + ": the greedy buckets in reverse order", hidden)


def _bucketed_runs(hidden: bool) -> list[tuple]:
    cases = [dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=700),
             dict(model_kwargs=MODELS["unused"], steps=3, batch=24, cap=700)]
    if hidden:
        cases += [dict(model_kwargs=MODELS["tied"], steps=3, batch=24, cap=300),
                  dict(model_kwargs={"tied": True, "frozen": True, "unused": True}, steps=3, batch=24, cap=4),
                  dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=1 << 20)]
    return [(n, cases) for n in ((3, 4) if hidden else (2,))]


JUDGED_BUCKETED = Judged(__name__, "BucketedDDP", _bucketed_runs, from_raising(_trained("BucketedDDP")))


@judged(JUDGED_BUCKETED)
@passes_quietly
def check_bucketed_ddp(BucketedDDP, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Training with ``BucketedDDP(model, bucket_cap_bytes)`` (``finish_gradient_sync()``
    after every backward) equals single-process training on the whole batch."""
    runs = _bucketed_runs(hidden)
    _launched(JUDGED_BUCKETED, dict(hidden=hidden), _train_and_probe, "bucketed_ddp", BucketedDDP, "BucketedDDP",
              timeout)
    report_passed("BucketedDDP", f"N={', '.join(str(n) for n, _ in runs)}, {len(runs[0][1])} models and caps: "
                                 f"parameters vs one process, a rank-dependent model", hidden)


JUDGED_BUCKETED_TRAFFIC = Judged(__name__, "BucketedDDP traffic", lambda: [
    (n, [dict(model_kwargs=MODELS["plain"], steps=2, batch=24, cap=700),
         dict(model_kwargs={"unused": True, "frozen": True}, steps=2, batch=24, cap=2000)]) for n in (2, 3)],
    from_raising(bucketed_traffic), params=())


@judged(JUDGED_BUCKETED_TRAFFIC)
@passes_quietly
def check_bucketed_ddp_traffic(BucketedDDP, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Per step: one all-reduce per bucket (not per parameter), Ψ·4 bytes of payload in all."""
    _launched(JUDGED_BUCKETED_TRAFFIC, {}, _train_body, "bucketed_ddp", BucketedDDP, "BucketedDDP", timeout)
    report_passed("BucketedDDP traffic", "N=2, 3: one all-reduce per bucket, Ψ·4 bytes per step")


JUDGED_OVERLAP = Judged(__name__, "BucketedDDP overlap", lambda: [2048], from_raising(overlapped), params=())


@judged(JUDGED_OVERLAP)
@passes_quietly
def check_overlap(BucketedDDP, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """The first bucket's all-reduce starts from a gradient hook, before backward has
    produced its last gradient, and backward never waits for it: rank 0 produces its last
    gradient before rank 1 has started (lab2_cases.overlap_probe), which only asynchronous
    all-reduces allow (communication overlaps the rest of backward)."""
    JUDGED_OVERLAP.run({}, lambda cap: launch_named(overlap_probe, 2, BucketedDDP, cap, name="BucketedDDP overlap",
                                                    timeout=timeout, refuse=REFUSED))
    report_passed("BucketedDDP overlap", "N=2: the first bucket's all-reduce starts before backward ends, backward "
                                         "never waits for it")
