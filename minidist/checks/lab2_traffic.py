"""Lab 2's traffic checks: what a data-parallel step must send (Li et al. 2020, *PyTorch
Distributed*, §3.2: every gradient all-reduced once per step; with buckets, one all-reduce per
bucket). Each takes a run ``(n, cases)`` and every rank's training results (plain data, the
traced ``events`` as (op, payload bytes)) and raises AssertionError with the first problem; the
checks of :mod:`minidist.checks.lab2_data_parallel` and the grader's judge both call them.
"""
from __future__ import annotations

from minidist.checks.kit.training import describe_case
from minidist.models import TinyMLP


def _all_reduced_once(run, out, label):
    """Per case and rank: only all-reduces, carrying Ψ·4 bytes in all (every trainable gradient
    exactly once). Yields ``(what, case, res)`` for the caller's rule on the number of calls."""
    n, cases = run
    for i, case in enumerate(cases):
        for r in range(n):
            res = out[r][i]
            what = f"{label} (world_size={n}, {describe_case(case)}), rank {r}"
            ops = sorted({op for op, _ in res["events"]})
            if ops != ["all_reduce"]:
                raise AssertionError(f"{what}: expected only all_reduce calls, saw {ops or 'no communication'}")
            total = sum(b for _, b in res["events"])
            if total != 4 * res["numel"]:
                raise AssertionError(f"{what}: all-reduced {total} bytes of gradients per step; expected "
                                     f"Ψ·4 = {4 * res['numel']} (every trainable parameter's gradient once; "
                                     f"frozen parameters have none, a tied weight counts once)")
            yield what, case, res


def average_traffic(run, out) -> None:
    """One all-reduce per trainable parameter, Ψ·4 bytes of payload in all, nothing else."""
    for what, case, res in _all_reduced_once(run, out, "average_gradients"):
        n_params = len([p for p in TinyMLP(**case["model_kwargs"]).parameters() if p.requires_grad])
        if len(res["events"]) != n_params:
            raise AssertionError(f"{what}: {len(res['events'])} all-reduces per step; expected one per "
                                 f"trainable parameter ({n_params})")


def bucketed_traffic(run, out) -> None:
    """Per step: one all-reduce per bucket (not per parameter), Ψ·4 bytes of payload in all."""
    for what, _, res in _all_reduced_once(run, out, "BucketedDDP"):
        if len(res["events"]) != res["buckets"]:
            raise AssertionError(f"{what}: {len(res['events'])} all-reduces per step for "
                                 f"{res['buckets']} buckets; expected one all-reduce per bucket "
                                 f"(that is the point of bucketing: fewer, bigger messages)")
