"""Lab 11's cases (hiding communication behind computation): the graded functions, their visible
cases (the hidden ones are the grader's, in ``hidden.py``), the inputs every rank and the verdict
draw from seeds, and the ✓ text.

A distributed case is a dict with ``t``, the size of the group it runs on (4 ranks cut into blocks of
t consecutive ranks: t = 3 leaves rank 3 in a group of one, t = 4 is ``group=None``), and its sizes.
Group rank s draws its own data from seed ``base + s``, so a verdict rebuilds every rank's inputs.
``exposed_time`` is judged in this process, on event lists written in ``timeline_events``.
"""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import seeded
from minidist.checks.kit.withheld import hidden_cases

WORLD = 4
F32 = torch.float32
GRADED = ("prefetch_forward", "all_gather_matmul", "matmul_reduce_scatter", "exposed_time")
DISTRIBUTED = GRADED[:3]

#: the visible cases of the distributed functions (sizes divide by t = 1..4)
VISIBLE = {
    "prefetch_forward": [dict(t=2, units=3, d=12, rows=5), dict(t=4, units=3, d=12, rows=5)],
    "all_gather_matmul": [dict(t=2, n=3, k=8, m=6), dict(t=4, n=3, k=8, m=6)],
    "matmul_reduce_scatter": [dict(t=2, n=3, k=8, m=6), dict(t=4, n=3, k=8, m=6)],
}


def function_cases(name: str, hidden: bool) -> list[dict]:
    """The cases of graded function ``name``: the visible ones, then the hidden ones."""
    if name not in GRADED:
        raise ValueError(f"lab 11 has no graded function {name!r}; graded: {', '.join(GRADED)}")
    if name == "exposed_time":
        return VISIBLE_TIMELINES + (hidden_cases(__package__, name).TIMELINES if hidden else [])
    return VISIBLE[name] + (hidden_cases(__package__, name).MORE[name] if hidden else [])


def covered(name: str, hidden: bool) -> str:
    """What a passing test proved (the ✓ line), from the cases that ran."""
    cases = function_cases(name, hidden)
    if name == "exposed_time":
        return f"{len(cases)} timelines: the union of the rank's waits, as minidist.trace.timeline measures it"
    ts = ", ".join(str(t) for t in sorted({c["t"] for c in cases}))
    dtypes = "/".join(sorted({str(c.get("dtype", F32)).replace("torch.float", "fp") for c in cases}))
    what = {"prefetch_forward": "output vs one process, the next unit's all-gather issued before this unit "
                                "computes and waited after, one unit ahead, one all-gather of a shard per unit",
            "all_gather_matmul": "output vs one process, each next chunk's send and receive posted before this "
                                 "chunk's matmul and waited after it, t - 1 shards sent around the ring",
            "matmul_reduce_scatter": "output vs one process, each accumulator's send posted before the next "
                                     "chunk's matmul and waited after it, t - 1 chunks sent around the ring"}[name]
    return f"t = {ts}, {dtypes}: {what}"


# ----------------------------------------------------------------------------- inputs (CPU, from seeds)
def unit_weights(case: dict) -> list[torch.Tensor]:
    """prefetch_forward: every unit's full (d, d) weight, scaled so that tanh stays in its live range."""
    d, dtype = case["d"], case.get("dtype", F32)
    return [seeded((d, d), 50 + i, dtype) / d ** 0.5 for i in range(case["units"])]


def prefetch_input(case: dict) -> torch.Tensor:
    return seeded((case["rows"], case["d"]), 40, case.get("dtype", F32))


def weight_shard(w: torch.Tensor, r: int, t: int) -> torch.Tensor:
    """Group rank r's rows of a unit's weight: what all_gather_into_tensor stacks back along dim 0."""
    return w.tensor_split(t, 0)[r]


def prefetch_reference(case: dict) -> torch.Tensor:
    """One process: x through every unit, x = tanh(x Wᵢᵀ)."""
    x = prefetch_input(case)
    for w in unit_weights(case):
        x = torch.tanh(x @ w.T)
    return x


def ag_shards(case: dict, t: int) -> list[torch.Tensor]:
    """all_gather_matmul: every group rank's (n, k) chunk of the sequence."""
    return [seeded((case["n"], case["k"]), 100 + s, case.get("dtype", F32)) for s in range(t)]


def ag_weight(case: dict) -> torch.Tensor:
    return seeded((case["m"], case["k"]), 7, case.get("dtype", F32))


def ag_reference(case: dict, t: int) -> torch.Tensor:
    return torch.cat(ag_shards(case, t)) @ ag_weight(case).T


def rs_inputs(case: dict, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """matmul_reduce_scatter: every group rank's (x, weight): the whole sequence (t·n, k) of its own input
    features and its (m, k) row-parallel weight shard."""
    dtype = case.get("dtype", F32)
    return [(seeded((t * case["n"], case["k"]), 200 + s, dtype), seeded((case["m"], case["k"]), 300 + s, dtype))
            for s in range(t)]


def rs_reference(case: dict, r: int, t: int) -> torch.Tensor:
    """Group rank r's chunk of Σ over the group's ranks of x Wᵀ."""
    total = sum(x.double() @ w.double().T for x, w in rs_inputs(case, t))
    return total.tensor_split(t, 0)[r].to(case.get("dtype", F32))


# ----------------------------------------------------------------------------- timelines for exposed_time
def comm(op, rank, start, end, issued=None, waited=None) -> dict:
    """A communication event as ``Trace.to_dicts()`` writes one (the fields exposed_time reads)."""
    return dict(op=op, rank=rank, peer=None, group=None, nbytes=64, start=start, end=end, tag=0, where="",
                meta={}, issued=issued, waited=waited)


def region(op, rank, start, end) -> dict:
    return {**comm(op, rank, start, end), "nbytes": 0}


#: visible timelines: a blocking all-reduce; an isend hidden behind a matmul then waited for; two blocking calls
#: whose waits overlap an asynchronous one's (counted once); another rank's events and compute regions in between
VISIBLE_TIMELINES = [
    dict(rank=0, events=[comm("all_reduce", 0, 1.0, 1.5), region("compute:matmul", 0, 1.5, 2.5)]),
    dict(rank=1, events=[comm("isend", 1, 0.0, 2.0, issued=0.1, waited=1.6), region("compute:matmul", 1, 0.1, 1.6),
                         comm("irecv", 0, 0.0, 3.0, issued=0.2, waited=0.5)]),
    dict(rank=0, events=[comm("irecv", 0, 0.0, 4.0, issued=0.25, waited=2.0), comm("recv", 0, 2.5, 3.5),
                         comm("send", 0, 3.0, 3.2), region("span:step", 0, 0.0, 5.0),
                         region("api:ring", 0, 0.0, 4.0), comm("all_reduce", 2, 0.0, 5.0)]),
]
