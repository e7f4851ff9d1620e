"""Lab 2's verdicts: ``split_batch``'s blocks and ``make_buckets``' buckets against the contract,
training against one process (:mod:`minidist.checks.kit.training`), the rank-dependent model's
gradients against the mean of the local ones (computed here), the traced traffic (Li et al. 2020,
*PyTorch Distributed*, §3.2: every gradient all-reduced once per step; with buckets, one all-reduce
per bucket) and the overlap probe's timings."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist.checks.kit.compare import digest, first, tensor_error, unchanged
from minidist.checks.kit.returned import returned_problem
from minidist.checks.kit.training import describe_case, equal_problem
from minidist.checks.lab2_data_parallel.cases import (PROBE_STEPS, RankDependentNet, bucket_params, probe_batch,
                                                      split_inputs)
from minidist.models import TinyMLP


# ----------------------------------------------------------------------------- split_batch
def split(case, answer) -> str | None:
    x, y = split_inputs(case)
    if case[0] == "bad":
        if answer.get("raised") == "ValueError":
            return None
        return (f"split_batch(x of shape {tuple(x.shape)}, world_size={case[2]}) must raise ValueError: {case[1]} rows "
                f"do not split evenly into {case[2]} ranks (silently dropping rows changes the loss)")
    _, batch, n = case
    xs = []
    for r, seen in enumerate(answer):
        call = f"split_batch(batch={batch}, rank={r}, world_size={n})"
        if problem := returned_problem(seen):
            return problem
        for what, original in (("x", x), ("y", y)):
            if problem := unchanged(what, seen[what], original, call):
                return problem
        got = seen["returned"]
        if not (isinstance(got, tuple) and len(got) == 2):
            return f"{call} must return a tuple (x_local, y_local), got {type(got).__name__}"
        for what, t, full in (("x", got[0], x), ("y", got[1], y)):
            if not isinstance(t, torch.Tensor) or t.shape != (batch // n, full.shape[1]):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                return (f"{call}: {what}_local has shape {shape}; expected {(batch // n, full.shape[1])} "
                        f"(batch / world_size rows)")
        want = slice(r * (batch // n), (r + 1) * (batch // n))
        if tensor_error("x_local", got[0], x[want], tol=0.0) or tensor_error("y_local", got[1], y[want], tol=0.0):
            rows = [int(v) for v in (got[0][:, 0] / 3).tolist()]
            return (f"{call}: rank {r} got rows {rows} of x; expected the contiguous block "
                    f"{list(range(want.start, want.stop))} (and the same rows of y)")
        xs.append(got[0])
    if not torch.equal(torch.cat(xs), x):
        return f"split_batch(batch={batch}, world_size={n}): the ranks' slices together are not the batch"
    return None


# ----------------------------------------------------------------------------- make_buckets
def expected_buckets(sizes, cap, fits_exactly: bool = True) -> list[list[int]]:
    """Greedy, in reverse parameter order: a bucket is closed when the next parameter would pass the cap
    (``fits_exactly=False``: already when it would reach it, the classic off-by-one)."""
    out, cur, size = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and (size + sizes[i] > cap if fits_exactly else size + sizes[i] >= cap):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += sizes[i]
    return out + ([cur] if cur else [])


def buckets(case, answer) -> str | None:
    shapes, dtypes, cap = case
    if "foreign" in answer:
        return returned_problem(answer)
    params = bucket_params(case)
    sizes = [p.numel() * p.element_size() for p in params]
    if answer["after"] != [digest(p) for p in params]:
        return f"make_buckets(cap_bytes={cap}) changed the values of the parameters it was given; it only groups them"
    got = answer["buckets"]
    if isinstance(got, str):
        return f"make_buckets(cap_bytes={cap}) must return a list of lists of the given parameters, got {got}"
    want = expected_buckets(sizes, cap)
    # the contract fixes the buckets and their order, not the order inside a bucket
    if [sorted(b) for b in got] != [sorted(b) for b in want] or sum(map(len, got)) != len(params):
        kinds = sorted({str(dt).replace("torch.", "") for dt in dtypes})
        return (_bucket_cause(got, sizes, cap, params) + f"make_buckets(params of {sizes} bytes ({'/'.join(kinds)}), cap_bytes={cap}): got buckets (as "
                f"parameter indices) {got}; expected {want} (any order inside a bucket). Buckets are filled "
                f"greedily in REVERSE order (the order backward produces gradients), a bucket holds at most "
                f"cap_bytes unless one tensor alone is bigger (a parameter's bytes: numel() * element_size()), "
                f"and every parameter appears exactly once.")
    return None


def _bucket_cause(got, sizes, cap, params) -> str:
    """The rule a classic wrong answer breaks, named first (the two rules the text stresses)."""
    if got == expected_buckets(sizes, cap, fits_exactly=False) != expected_buckets(sizes, cap):
        return (f"A bucket of exactly cap_bytes = {cap} bytes was split: exactly cap_bytes still fits "
                f"(close a bucket only when the next parameter would take it OVER the cap). ")
    as_fp32 = [p.numel() * 4 for p in params]
    if as_fp32 != sizes and got == expected_buckets(as_fp32, cap):
        return ("These are the buckets of 4 bytes per element: a parameter's size in bytes is "
                "p.numel() * p.element_size() (not every model is float32). ")
    return ""


# ----------------------------------------------------------------------------- training
def average(case, answers: list) -> str | None:
    """Training with ``average_gradients`` equals one process; the rank-dependent model's gradients are the mean."""
    return _trained("average_gradients", case, answers)


def bucketed(case, answers: list) -> str | None:
    """Training with ``BucketedDDP`` equals one process; the rank-dependent model's gradients are the mean."""
    return _trained("BucketedDDP", case, answers)


def _trained(name: str, case, answers: list) -> str | None:
    n, cases = case
    return first([equal_problem(name, n, cases, [a["trained"] for a in answers]),
                  rank_dependent(name, n, [a["probe"] for a in answers])])


def _local_grads(world_size: int) -> list[list[list]]:
    """[step][rank]: every rank's local gradients on the rank-dependent model (None: a layer it did not use)."""
    out = []
    for step in range(PROBE_STEPS):
        per_rank = []
        for r in range(world_size):
            model = RankDependentNet(r)
            x, y = probe_batch(step, r, world_size, device="cpu")
            F.mse_loss(model(x), y).backward()
            per_rank.append([p.grad for p in model.parameters()])
        out.append(per_rank)
    return out


def rank_dependent(name: str, world_size: int, per_rank: list, tol: float = 1e-5) -> str | None:
    """Every rank's synced gradients equal the mean of the ranks' local ones (a missing one counts
    as zeros) and are identical on every rank."""
    names = [k for k, _ in RankDependentNet(0).named_parameters()]
    what = (f"{name} (world_size={world_size}, RankDependentNet: layer 'mid' used on even ranks only, "
            f"branches 'a' and 'b' computed in another order on odd ranks, so their hooks fire in another order)")
    local = _local_grads(world_size)
    for step in range(PROBE_STEPS):
        for k, pname in enumerate(names):
            used = [g[k] for g in local[step] if g[k] is not None]     # every parameter on some rank
            want = torch.stack(used).sum(0) / world_size
            for r in range(world_size):
                got = per_rank[r][step][k]
                if got is None:
                    return (f"{what}, step {step}: rank {r} has no gradient for '{pname}' after the sync, but other "
                            f"ranks used it; every rank needs the average (a rank that did not use a parameter "
                            f"contributes zeros and still receives the mean)")
                if problem := tensor_error(f"rank {r}'s gradient of '{pname}'", got, want, tol=tol,
                                           against="the mean over ranks of the local gradients"):
                    return (f"{what}, step {step}: {problem}. Every rank must make the same collective calls, in "
                            f"the same order, on the same tensors, whichever layers it used and whatever order "
                            f"its hooks fired in.")
            if any(not torch.equal(per_rank[r][step][k], per_rank[0][step][k]) for r in range(world_size)):
                return (f"{what}, step {step}: the ranks hold different gradients for '{pname}' after the sync: "
                        f"the replicas will drift apart")
    return None


# ----------------------------------------------------------------------------- traffic
def _all_reduced_once(case, answers, label):
    """Per case and rank: only all-reduces, carrying Ψ·4 bytes in all (every trainable gradient
    exactly once): a problem, or ``(what, case, result)`` for the caller's rule on the number of calls."""
    n, cases = case
    for i, training in enumerate(cases):
        for r in range(n):
            res = answers[r][i]
            what = f"{label} (world_size={n}, {describe_case(training)}), rank {r}"
            ops = sorted({op for op, _ in res["events"]})
            if ops != ["all_reduce"]:
                yield f"{what}: expected only all_reduce calls, saw {ops or 'no communication'}"
                return
            total = sum(b for _, b in res["events"])
            if total != 4 * res["numel"]:
                yield (f"{what}: all-reduced {total} bytes of gradients per step; expected Ψ·4 = {4 * res['numel']} "
                       f"(every trainable parameter's gradient once; frozen parameters have none, a tied weight "
                       f"counts once)")
                return
            yield what, training, res


def average_traffic(case, answers) -> str | None:
    """One all-reduce per trainable parameter, Ψ·4 bytes of payload in all, nothing else."""
    for item in _all_reduced_once(case, answers, "average_gradients"):
        if isinstance(item, str):
            return item
        what, training, res = item
        n_params = len([p for p in TinyMLP(**training["model_kwargs"]).parameters() if p.requires_grad])
        if len(res["events"]) != n_params:
            return (f"{what}: {len(res['events'])} all-reduces per step; expected one per trainable parameter "
                    f"({n_params})")
    return None


def bucketed_traffic(case, answers) -> str | None:
    """Per step: one all-reduce per bucket (not per parameter), Ψ·4 bytes of payload in all."""
    for item in _all_reduced_once(case, answers, "BucketedDDP"):
        if isinstance(item, str):
            return item
        what, _, res = item
        if len(res["events"]) != res["buckets"]:
            return (f"{what}: {len(res['events'])} all-reduces per step for {res['buckets']} buckets; expected one "
                    f"all-reduce per bucket (that is the point of bucketing: fewer, bigger messages)")
    return None


# ----------------------------------------------------------------------------- overlap
def overlap(cap, answers) -> str | None:
    """Both ranks' overlap probes: rank 0's backward produced its last gradient before rank 1 started
    (only asynchronous all-reduces allow it), and the first all-reduce started before that gradient."""
    head = f"BucketedDDP overlap (world_size=2, bucket_cap_bytes={cap})"
    if answers[1]["waited_out"]:
        return (f"{head}: rank 0's backward could not produce its last gradient while rank 1 had not started yet: "
                "backward waited for an all-reduce to complete (a blocking all_reduce, or wait() inside the hook). "
                "Launch with async_op=True and wait only in finish_gradient_sync, so that communication runs "
                "while backward keeps computing.")
    for r, res in enumerate(answers):
        if len(res["starts"]) < 2:
            return f"{head}, rank {r}: {len(res['starts'])} all-reduce(s) for {res['buckets']} buckets"
        if res["last"] is None or not res["starts"][0] < res["last"]:
            return (f"{head}, rank {r}: no all-reduce started before backward produced its last gradient. Launch "
                    f"a bucket's all-reduce with async_op=True from the gradient hook as soon as the bucket is "
                    f"full, not after backward.")
    return None
