"""Lab 2's checks (data parallelism): split_batch, average_gradients, make_buckets, BucketedDDP.

One call runs a student's function or class on N ranks, trains with it through the one
data-parallel loop (:mod:`minidist.checks.training`), compares with single-process training
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

from minidist.checks.common import TRAINING_CHECK_TIMEOUT, Refusal, graded_call, launch_named, report_passed
from minidist.checks.returned import require_plain
from minidist.checks.lab2_cases import check_rank_dependent, overlap_probe, rank_dependent_grads
from minidist.checks.training import _train_body, check_equal, describe_case, train_student
from minidist.checks.quiet import passes_quietly
from minidist.models import TINY_MLP_VARIANTS as MODELS, TinyMLP, describe_mlp

#: minidist's data parallelism (NaiveDDP, BucketedDDP, make_buckets, ...) is refused in graded code.
REFUSED = Refusal("data parallelism", ("minidist.data_parallel",), checks=__name__)


def _cases(models, cap=None, steps=3, batch=24):
    return [dict(model_kwargs=MODELS[m], steps=steps, batch=batch, cap=cap) for m in models]


def _train_and_probe(progress, cases, kind, impl):
    """The training cases, then the rank-dependent model (lab2_cases), in the same launch."""
    return _train_body(progress, cases, kind, impl), rank_dependent_grads(progress, kind, impl)


def _train_checked(name, kind, impl, n, cases, timeout):
    """Train ``cases`` and probe the rank-dependent model on ``n`` ranks; check both."""
    out = launch_named(_train_and_probe, n, cases, kind, impl, name=name, timeout=timeout, refuse=REFUSED)
    check_equal(name, n, cases, [o[0] for o in out])
    check_rank_dependent(name, n, [o[1] for o in out])


# ----------------------------------------------------------------------------- lab 2: split
@passes_quietly
def check_split_batch(split_batch, hidden: bool = False) -> None:
    """``split_batch(x, y, rank, world_size)`` -> rank's contiguous block of x and of y;
    a batch that does not divide by world_size raises ValueError. Pure: no launch."""
    sizes = [(12, 2), (12, 3), (12, 4)] + ([(24, 4), (5, 5), (7, 1), (30, 6)] if hidden else [])
    for batch, n in sizes:
        x, y = torch.arange(batch * 3.0).view(batch, 3), torch.arange(batch * 2.0).view(batch, 2) + 1000
        xs, ys = [], []
        for r in range(n):
            x_before, y_before = x.clone(), y.clone()
            got = graded_call(REFUSED, "split_batch", split_batch, x, y, r, n)
            require_plain(f"split_batch(batch={batch}, rank={r}, world_size={n})", got)
            if not (torch.equal(x, x_before) and torch.equal(y, y_before)):
                raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}) changed the caller's x or "
                                     f"y; return slices (views) of them and leave the batch as it was")
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}) must return a "
                                     f"tuple (x_local, y_local), got {type(got).__name__}")
            xr, yr = got
            for what, t, full in (("x", xr, x), ("y", yr, y)):
                if not isinstance(t, torch.Tensor) or t.shape != (batch // n, full.shape[1]):
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}): {what}_local has "
                                         f"shape {shape}; expected {(batch // n, full.shape[1])} (batch / world_size rows)")
            want = slice(r * (batch // n), (r + 1) * (batch // n))
            if not (torch.equal(xr, x[want]) and torch.equal(yr, y[want])):
                rows = [int(v) for v in (xr[:, 0] / 3).tolist()]
                raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}): rank {r} got rows "
                                     f"{rows} of x; expected the contiguous block {list(range(want.start, want.stop))} "
                                     f"(and the same rows of y)")
            xs.append(xr)
            ys.append(yr)
        if not torch.equal(torch.cat(xs), x):
            raise AssertionError(f"split_batch(batch={batch}, world_size={n}): the ranks' slices together are not the batch")
    # hidden: feature counts that make x.numel() and y.numel() divisible by world_size when the
    # batch is not (a check on the wrong quantity passes the visible case only)
    for batch, n, d in [(10, 4, 3)] + ([(6, 4, 2), (7, 2, 2), (3, 4, 4), (9, 6, 2)] if hidden else []):
        x, y = torch.zeros(batch, d), torch.zeros(batch, 2 * d)
        try:
            graded_call(REFUSED, "split_batch", split_batch, x, y, 0, n)
        except ValueError:
            continue
        raise AssertionError(f"split_batch(x of shape {tuple(x.shape)}, world_size={n}) must raise ValueError: {batch} rows do not "
                             f"split evenly into {n} ranks (silently dropping rows changes the loss)")
    report_passed("split_batch", f"{len(sizes)} (batch, world size) pairs: each rank's contiguous rows, "
                                 f"inputs unchanged; ValueError when rows do not split", hidden)


# ----------------------------------------------------------------------------- lab 2: naive DDP
@passes_quietly
def check_average_gradients(average_gradients, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Training with ``average_gradients(model)`` after every backward equals single-process
    training on the whole batch (SGD with momentum, 3 steps)."""
    sizes = (3, 4) if hidden else (2,)
    models = list(MODELS) if hidden else ["plain", "frozen"]
    for n in sizes:
        _train_checked("average_gradients", "average_gradients", average_gradients, n, _cases(models), timeout)
    report_passed("average_gradients", f"N={', '.join(map(str, sizes))}, models {', '.join(models)}: parameters vs "
                                       f"one process on the whole batch, a rank-dependent model", hidden)


@passes_quietly
def check_average_gradients_traffic(average_gradients, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """One all-reduce per trainable parameter, Ψ·4 bytes of payload in all, nothing else."""
    for n in (2, 3):
        cases = _cases(["frozen", "tied"])
        out = train_student("average_gradients", average_gradients, n, cases, "average_gradients", timeout, REFUSED)
        for i, case in enumerate(cases):
            for r in range(n):
                res = out[r][i]
                what = f"average_gradients (world_size={n}, {describe_mlp(case['model_kwargs'])}), rank {r}"
                ops = sorted({op for op, _ in res["events"]})
                if ops != ["all_reduce"]:
                    raise AssertionError(f"{what}: expected only all_reduce calls, saw {ops or 'no communication'}")
                n_params = len([p for p in TinyMLP(**case["model_kwargs"]).parameters() if p.requires_grad])
                total = sum(b for _, b in res["events"])
                if total != 4 * res["numel"]:
                    raise AssertionError(f"{what}: all-reduced {total} bytes of gradients per step; expected "
                                         f"Ψ·4 = {4 * res['numel']} (every trainable parameter's gradient once; "
                                         f"frozen parameters have none, a tied weight counts once)")
                if len(res["events"]) != n_params:
                    raise AssertionError(f"{what}: {len(res['events'])} all-reduces per step; expected one per "
                                         f"trainable parameter ({n_params})")
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


@passes_quietly
def check_make_buckets(make_buckets, hidden: bool = False) -> None:
    """Greedy buckets of at most ``cap_bytes``, in reverse parameter order; a tensor bigger
    than the cap gets a bucket of its own. Pure: no launch."""
    fp32, fp64, bf16 = ([dt] * len(_SHAPES) for dt in (torch.float32, torch.float64, torch.bfloat16))
    configs = [(_SHAPES, fp32, 700), (_SHAPES, fp32, 2000)]
    if hidden:
        configs += [(_SHAPES, fp32, 4), (_SHAPES, fp32, 10 ** 6), (_SHAPES, fp32, 676), (_SHAPES, fp32, 728),
                    ([(3,)], fp32[:1], 12), ([(100,), (1,), (1,)], fp32[:3], 8),
                    (_SHAPES, fp64, 700), (_SHAPES, fp64, 2704), (_SHAPES, bf16, 400), (_SHAPES, bf16, 338)]
    for shp, dtypes, cap in configs:
        params = [torch.nn.Parameter(torch.arange(math.prod(s), dtype=dt).view(s)) for s, dt in zip(shp, dtypes)]
        sizes = [p.numel() * p.element_size() for p in params]
        idx = {id(p): i for i, p in enumerate(params)}      # before the call: it may reorder its argument
        before = [p.detach().clone() for p in params]
        got = graded_call(REFUSED, "make_buckets", make_buckets, params, cap)
        require_plain(f"make_buckets(cap_bytes={cap})", got)
        if not all(torch.equal(p.detach(), b) for p, b in zip(sorted(params, key=lambda p: idx[id(p)]), before)):
            raise AssertionError(f"make_buckets(cap_bytes={cap}) changed the values of the parameters it was given; "
                                 f"it only groups them")
        try:
            got_idx = [[idx[id(p)] for p in b] for b in got]
        except (KeyError, TypeError):
            raise AssertionError(f"make_buckets(cap_bytes={cap}) must return a list of lists of the given "
                                 f"parameters, got {got!r:.200}") from None
        want = _expected_buckets(sizes, cap)
        # the contract fixes the buckets and their order, not the order inside a bucket
        if [sorted(b) for b in got_idx] != [sorted(b) for b in want] or sum(map(len, got_idx)) != len(params):
            kinds = sorted({str(dt).replace("torch.", "") for dt in dtypes})
            raise AssertionError(
                f"make_buckets(params of {sizes} bytes ({'/'.join(kinds)}), cap_bytes={cap}): got buckets (as "
                f"parameter indices) {got_idx}; expected {want} (any order inside a bucket). Buckets are filled "
                f"greedily in REVERSE order (the order backward produces gradients), a bucket holds at most "
                f"cap_bytes unless one tensor alone is bigger (a parameter's bytes: numel() * element_size()), "
                f"and every parameter appears exactly once.")
    report_passed("make_buckets", f"{len(configs)} caps" + (" in fp32/fp64/bf16" if hidden else " in fp32")
                  + ": the greedy buckets in reverse order", hidden)


@passes_quietly
def check_bucketed_ddp(BucketedDDP, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Training with ``BucketedDDP(model, bucket_cap_bytes)`` (``finish_gradient_sync()``
    after every backward) equals single-process training on the whole batch."""
    sizes = (3, 4) if hidden else (2,)
    for n in sizes:
        cases = [dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=700),
                 dict(model_kwargs=MODELS["unused"], steps=3, batch=24, cap=700)]
        if hidden:
            cases += [dict(model_kwargs=MODELS["tied"], steps=3, batch=24, cap=300),
                      dict(model_kwargs={"tied": True, "frozen": True, "unused": True}, steps=3, batch=24, cap=4),
                      dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=1 << 20)]
        _train_checked("BucketedDDP", "bucketed_ddp", BucketedDDP, n, cases, timeout)
    report_passed("BucketedDDP", f"N={', '.join(map(str, sizes))}, {len(cases)} models and caps: parameters vs one "
                                 f"process, a rank-dependent model", hidden)


@passes_quietly
def check_bucketed_ddp_traffic(BucketedDDP, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Per step: one all-reduce per bucket (not per parameter), Ψ·4 bytes of payload in all."""
    for n in (2, 3):
        cases = [dict(model_kwargs=MODELS["plain"], steps=2, batch=24, cap=700),
                 dict(model_kwargs={"unused": True, "frozen": True}, steps=2, batch=24, cap=2000)]
        out = train_student("bucketed_ddp", BucketedDDP, n, cases, "BucketedDDP", timeout, REFUSED)
        for i, case in enumerate(cases):
            for r in range(n):
                res = out[r][i]
                what = f"BucketedDDP (world_size={n}, {describe_case(case)}), rank {r}"
                ops = sorted({op for op, _ in res["events"]})
                if ops != ["all_reduce"]:
                    raise AssertionError(f"{what}: expected only all_reduce calls, saw {ops or 'no communication'}")
                total = sum(b for _, b in res["events"])
                if total != 4 * res["numel"]:
                    raise AssertionError(f"{what}: all-reduced {total} bytes per step; expected Ψ·4 = "
                                         f"{4 * res['numel']} (each gradient exactly once)")
                if len(res["events"]) != res["buckets"]:
                    raise AssertionError(f"{what}: {len(res['events'])} all-reduces per step for "
                                         f"{res['buckets']} buckets; expected one all-reduce per bucket "
                                         f"(that is the point of bucketing: fewer, bigger messages)")
    report_passed("BucketedDDP traffic", "N=2, 3: one all-reduce per bucket, Ψ·4 bytes per step")


@passes_quietly
def check_overlap(BucketedDDP, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """The first bucket's all-reduce starts from a gradient hook, before backward has
    produced its last gradient, and backward never waits for it: rank 0 produces its last
    gradient before rank 1 has started (lab2_cases.overlap_probe), which only asynchronous
    all-reduces allow (communication overlaps the rest of backward)."""
    out = launch_named(overlap_probe, 2, BucketedDDP, 2048, name="BucketedDDP overlap", timeout=timeout,
                       refuse=REFUSED)
    if out[1]["waited_out"]:
        raise AssertionError(
            "BucketedDDP overlap (world_size=2, bucket_cap_bytes=2048): rank 0's backward could not produce its "
            "last gradient while rank 1 had not started yet: backward waited for an all-reduce to complete (a blocking all_reduce, "
            "or wait() inside the hook). Launch with async_op=True and wait only in finish_gradient_sync, so "
            "that communication runs while backward keeps computing.")
    for r, res in enumerate(out):
        if len(res["starts"]) < 2:
            raise AssertionError(f"BucketedDDP overlap (world_size=2, bucket_cap_bytes=2048), rank {r}: "
                                 f"{len(res['starts'])} all-reduce(s) for {res['buckets']} buckets")
        if res["last"] is None or not res["starts"][0] < res["last"]:
            raise AssertionError(
                f"BucketedDDP overlap (world_size=2, bucket_cap_bytes=2048), rank {r}: no all-reduce started "
                f"before backward produced its last gradient. Launch a bucket's all-reduce with async_op=True "
                f"from the gradient hook as soon as the bucket is full, not after backward.")
    report_passed("BucketedDDP overlap", "N=2: the first bucket's all-reduce starts before backward ends, backward "
                                         "never waits for it")
