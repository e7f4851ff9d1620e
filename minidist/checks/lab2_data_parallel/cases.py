"""Lab 2's cases (data parallelism): the visible cases of every check (the hidden ones are the
grader's, in ``hidden.py``), their inputs, the rank-dependent model, and what a passing test's ✓ line
says it covered.

Training cases are dicts for :mod:`minidist.checks.kit.training` (``model_kwargs``, ``steps``,
``batch``, ``cap``); a launched check's case is ``(world size, its training cases)``, all of them
run in one launch (launching costs more than a tiny model). Equality runs use SGD with momentum:
Adam divides by the gradient's own scale, so it would not notice a gradient that was summed
instead of averaged.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from minidist.checks.kit.withheld import hidden_cases
from minidist.models import TINY_MLP_VARIANTS as MODELS, mlp_batch


def _sizes(sizes) -> str:
    return ", ".join(map(str, sizes))


# ----------------------------------------------------------------------------- split_batch
def split_cases(hidden: bool) -> list[tuple]:
    """("split", batch, world size): every rank's block; ("bad", batch, world size, features): must raise."""
    h = hidden_cases(__package__, "split_batch") if hidden else None
    sizes = [(12, 2), (12, 3), (12, 4)] + (h.SPLIT if hidden else [])
    bad = [(10, 4, 3)] + (h.SPLIT_BAD if hidden else [])
    return [("split", batch, n) for batch, n in sizes] + [("bad", batch, n, d) for batch, n, d in bad]


def split_inputs(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch (x, y) of a case: rows numbered, so a wrong block names its rows."""
    if case[0] == "bad":
        _, batch, n, d = case
        return torch.zeros(batch, d), torch.zeros(batch, 2 * d)
    batch = case[1]
    return torch.arange(batch * 3.0).view(batch, 3), torch.arange(batch * 2.0).view(batch, 2) + 1000


def split_covered(hidden: bool) -> str:
    cases = split_cases(hidden)
    return (f"{sum(c[0] == 'split' for c in cases)} (batch, world size) pairs: each rank's contiguous rows, "
            f"inputs unchanged; ValueError on {sum(c[0] == 'bad' for c in cases)} batches whose rows do not split")


# ----------------------------------------------------------------------------- average_gradients
def training(models, cap=None, steps=3, batch=24) -> list[dict]:
    return [dict(model_kwargs=MODELS[m], steps=steps, batch=batch, cap=cap) for m in models]


def _average_models(hidden: bool) -> list[str]:
    return hidden_cases(__package__, "average_gradients").AVERAGE_MODELS if hidden else ["plain", "frozen"]


def average_cases(hidden: bool) -> list[tuple]:
    """(world size, training cases) per launch; each launch also runs the rank-dependent model."""
    sizes = hidden_cases(__package__, "average_gradients").WORLD_SIZES if hidden else (2,)
    return [(n, training(_average_models(hidden))) for n in sizes]


AVERAGE_TRAFFIC_MODELS = ["frozen", "tied"]


def average_traffic_cases() -> list[tuple]:
    return [(n, training(AVERAGE_TRAFFIC_MODELS)) for n in (2, 3)]


def average_covered(hidden: bool) -> str:
    runs = average_cases(hidden)
    return (f"N={_sizes(n for n, _ in runs)}, models {', '.join(_average_models(hidden))}: parameters vs one "
            f"process on the whole batch, a rank-dependent model")


def average_traffic_covered() -> str:
    return (f"N={_sizes(n for n, _ in average_traffic_cases())}, models {', '.join(AVERAGE_TRAFFIC_MODELS)}: "
            f"one all-reduce per trainable parameter, Ψ·4 bytes")


# ----------------------------------------------------------------------------- make_buckets
#: the make_buckets cases' shapes, one dtype per model (a bucket is one flat buffer, so a real model
#: with mixed dtypes also splits buckets where the dtype changes)
SHAPES = [(13, 6), (13,), (13, 13), (13,), (13, 13), (13,), (5, 13), (5,)]


def same_dtype(shapes, dtype) -> list:
    """The dtypes of a case's parameters: ``dtype`` for every shape."""
    return [dtype] * len(shapes)


def bucket_cases(hidden: bool) -> list[tuple]:
    """(shapes, dtypes, cap_bytes)."""
    fp32 = same_dtype(SHAPES, torch.float32)
    # 728: the second bucket is exactly 676 + 52 bytes (exactly cap_bytes still fits); bf16 at 400: other
    # buckets than 4 bytes per element would give (a parameter's bytes are numel() * element_size())
    configs = [(SHAPES, fp32, 700), (SHAPES, fp32, 2000), (SHAPES, fp32, 728),
               (SHAPES, same_dtype(SHAPES, torch.bfloat16), 400)]
    if hidden:
        configs += [(shapes, same_dtype(shapes, dt), cap)
                    for shapes, dt, cap in hidden_cases(__package__, "make_buckets").BUCKETS]
    return configs


def bucket_params(case) -> list:
    shapes, dtypes, _ = case
    return [torch.nn.Parameter(torch.arange(math.prod(s), dtype=dt).view(s)) for s, dt in zip(shapes, dtypes)]


def bucket_covered(hidden: bool) -> str:
    dtypes = hidden_cases(__package__, "make_buckets").BUCKETS_SHOWN if hidden else "fp32/bf16"
    return (f"{len(bucket_cases(hidden))} (parameters, cap) cases in {dtypes}"
            + ": the greedy buckets in reverse order, a bucket of exactly the cap, bytes by dtype")


# ----------------------------------------------------------------------------- BucketedDDP
def bucketed_cases(hidden: bool) -> list[tuple]:
    cases = [dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=700),
             dict(model_kwargs=MODELS["unused"], steps=3, batch=24, cap=700)]
    if hidden:
        h = hidden_cases(__package__, "BucketedDDP")
        cases += [dict(model_kwargs=MODELS[m] if isinstance(m, str) else m, steps=3, batch=24, cap=cap)
                  for m, cap in h.BUCKETED]
    return [(n, cases) for n in (h.WORLD_SIZES if hidden else (2,))]


def bucketed_traffic_cases() -> list[tuple]:
    return [(n, [dict(model_kwargs=MODELS["plain"], steps=2, batch=24, cap=700),
                 dict(model_kwargs={"unused": True, "frozen": True}, steps=2, batch=24, cap=2000)]) for n in (2, 3)]


#: the overlap check's bucket cap: several buckets on its 4-layer MLP
OVERLAP_CAP = 2048


def overlap_cases() -> list[int]:
    return [OVERLAP_CAP]


def bucketed_covered(hidden: bool) -> str:
    runs = bucketed_cases(hidden)
    return (f"N={_sizes(n for n, _ in runs)}; {len(runs[0][1])} models and caps: parameters vs one process, "
            f"a rank-dependent model")


def bucketed_traffic_covered() -> str:
    runs = bucketed_traffic_cases()
    return (f"N={_sizes(n for n, _ in runs)}; {len(runs[0][1])} models and caps: one all-reduce per bucket, "
            f"Ψ·4 bytes per step")


def overlap_covered() -> str:
    return "N=2: the first bucket's all-reduce starts before backward ends, backward never waits for it"


# ----------------------------------------------------------------------------- the rank-dependent model
# Real data-parallel models do not always do the same work on every rank: a branch may run on some
# ranks only (a data-dependent path), and two branches may be computed in another order, so that
# autograd fires the gradient hooks in another order (Li et al. 2020, *PyTorch Distributed*, §3.2.3:
# buckets must be all-reduced in the same order on every rank, whatever order they fill in). What
# must come out, on every rank and every step, is the mean over ranks of the local gradients,
# (1/N) Σ_r g_r with a branch a rank did not run counting as zeros, bit-identical on every rank.

#: bytes of ``out``: with this cap every parameter of the hidden layers gets a bucket of its own
#: (8·8·4 = 256 and 8·4 = 32 bytes), so a bucket launched out of order is one of its own size.
PROBE_CAP = 180
PROBE_STEPS = 2


class RankDependentNet(nn.Module):
    """``inp -> a, b (summed) -> mid (even ranks only) -> out``, in that parameter order, as rank
    ``rank`` computes it (the answer builds it on a rank, the verdict once per rank on the CPU).

    Even ranks compute branch ``a`` before ``b``, odd ranks ``b`` before ``a``: autograd runs
    the later branch's backward first, so the gradient hooks of ``a`` and ``b`` fire in
    opposite orders on neighbouring ranks. ``mid`` (in the middle of the parameter list) is
    used on even ranks only: on odd ranks its gradient is missing.
    """

    def __init__(self, rank: int, d_in: int = 6, width: int = 8, d_out: int = 5, device=None):
        super().__init__()
        self.rank = rank
        g = torch.random.get_rng_state()
        torch.manual_seed(7)
        with torch.device("cpu"):           # the CPU generator draws the weights, then they move to the rank's device
            self.inp, self.a = nn.Linear(d_in, width), nn.Linear(width, width)
            self.mid, self.b = nn.Linear(width, width), nn.Linear(width, width)
            self.out = nn.Linear(width, d_out)
        torch.random.set_rng_state(g)
        self.to(device if device is not None else "cpu")

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        first, second = (self.a, self.b) if self.rank % 2 == 0 else (self.b, self.a)
        u = torch.tanh(first(h))
        h = u + torch.tanh(second(h))
        if self.rank % 2 == 0:
            h = h + torch.tanh(self.mid(h))
        return self.out(h)


def probe_batch(step: int, rank: int, world_size: int, device=None):
    """Rank ``rank``'s 4 rows of the rank-dependent model's batch at ``step``."""
    x, y = mlp_batch(100 + step, 4 * world_size, device=device)
    return x[4 * rank:4 * (rank + 1)], y[4 * rank:4 * (rank + 1)]
