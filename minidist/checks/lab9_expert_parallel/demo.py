"""Lab 9's measurement for its demo cells (not graded): the rows each rank's experts receive and the
bytes the student's dispatch sends under a balanced and a skewed router, next to the cost model."""
from __future__ import annotations

import torch.distributed as dist

import minidist
from minidist.checks.kit.compare import seeded
from minidist.checks.kit.launch import TIMEOUT, launch_named, mark_case, one_thread
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.lab9_expert_parallel.cases import F32, WORLD
from minidist.cost import expert_parallel as cost
from minidist.trace import trace

MEASURE_SETTINGS = (("balanced", 0.0, None), ("skewed", 1.5, None), ("skewed, capacity 1.25", 1.5, 1.25))


def _measure_body(progress, top_k_router, ep_dispatch, tokens, hidden, num_experts, k, settings):
    rank, device = dist.get_rank(), minidist.device()
    out = []
    for label, skew, cf in settings:
        mark_case(progress, label)
        x = seeded((tokens, hidden), 90 + rank, F32)
        w = seeded((hidden, num_experts), 91, F32) / hidden ** 0.5
        x[:, 0] = 1.0                                  # a constant feature: its weights are the experts' biases
        w[0] = 0.0
        w[0, :2] = skew                                # a bonus for experts 0 and 1, both on rank 0
        with one_thread():
            idx, _, keep = top_k_router((x @ w).to(device), k, cf)
            keep = keep.to(idx.device)
            with trace() as tr:
                _, route = ep_dispatch(x.to(device), idx.masked_fill(~keep, -1), num_experts)
        out.append(dict(setting=label, rank=rank, received=int(route.recv_counts.sum()), dropped=int((~keep).sum()),
                        sent=int(keep.sum()), bytes=sum(e.nbytes for e in tr.comm())))
    return out


@passes_quietly
def measure(top_k_router, ep_dispatch, tokens: int = 256, hidden: int = 32, num_experts: int = 8, k: int = 2,
            settings=MEASURE_SETTINGS, timeout: float = TIMEOUT) -> list[dict]:
    """On 4 ranks, for each (label, skew, capacity factor): your router on each rank's ``tokens`` tokens
    (a bonus logit ``skew`` for experts 0 and 1, on rank 0), then your dispatch. One row per (setting,
    rank): rows its experts ``received``, choices ``dropped``, ``bytes`` your dispatch sent (traced: the
    counts and the rows), ``theory`` (:func:`minidist.cost.expert_parallel.ep_collectives`, the same
    two exchanges), ``mean`` (n·k, a balanced rank's rows)."""
    out = launch_named(_measure_body, WORLD, top_k_router, ep_dispatch, tokens, hidden, num_experts, k,
                       tuple(settings), name="measure", timeout=timeout)
    rows = []
    for i in range(len(settings)):
        for rank_rows in out:
            row = dict(rank_rows[i])
            row["theory"] = sum(c.nbytes for c in cost.ep_collectives(row["sent"], row["received"], hidden,
                                                                      num_experts, WORLD)[:2])
            row["mean"] = tokens * k
            rows.append(row)
    return rows
