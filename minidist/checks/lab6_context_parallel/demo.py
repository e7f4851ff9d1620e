"""Lab 6's measurements for the notebook's demo cells (not graded): the bytes the student's Ulysses
and ring send in one forward, and the causal attention work per rank with contiguous and zigzag
shards, next to :mod:`minidist.cost.context_parallel`."""
from __future__ import annotations

import torch

from minidist import cost
from minidist.checks.kit.compare import on_rank, seeded
from minidist.checks.kit.groups import consecutive_groups
from minidist.checks.kit.launch import TIMEOUT, launch_named, mark_case, one_thread
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.lab6_context_parallel.cases import B, D, F32, H, WORLD, part
from minidist.trace import trace


def _measure_body(progress, ulysses_attention, ring_attention_forward, zigzag_shard, ts, seq):
    groups = consecutive_groups(ts, WORLD)
    rows = []
    for t in ts:
        group, r, size = groups[t]
        mark_case(progress, f"t={t}")
        full = [seeded((B, seq, H, D), 50 + i, F32) for i in range(3)]
        q, k, v = (on_rank(part(x, 1, r, size)) for x in full)
        with one_thread():
            with trace() as tu:
                ulysses_attention(q, k, v, True, group)
            with trace() as tr:
                ring_attention_forward(q, k, v, True, group)
            positions = {"contiguous": part(torch.arange(seq, device="cpu"), 0, r, size),
                         "zigzag": zigzag_shard(on_rank(torch.arange(seq, device="cpu"))[None], group)[0]}
        rows.append(dict(t=size, rank=r, ulysses_bytes=sum(e.nbytes for e in tu.comm()),
                         ring_bytes=sum(e.nbytes for e in tr.comm() if e.is_send),
                         ring_work=sum(e.meta.get("unmasked", 0) for e in tr.events if e.op == "span:attention block"),
                         **{f"{k}_work": int((p + 1).sum()) * B * H for k, p in positions.items()}))
    return rows


@passes_quietly
def measure(ulysses_attention, ring_attention_forward, zigzag_shard, ts=(1, 2, 4), seq: int = 48,
            timeout: float = TIMEOUT) -> list[dict]:
    """On 4 ranks, for each group size t (causal, fp32, b=2, h=12, d=4, sequence ``seq``): bytes
    each rank sent in one forward of your Ulysses (all-to-all inputs) and your ring (isends), next
    to ``minidist.cost.context_parallel``; and per rank the causal attention work (unmasked scores,
    over all batches and heads) that your ring's blocks did (from the helper's trace spans), with
    contiguous shards and with your zigzag shards (counted from the positions you return), next to
    ``cost.causal_scores``. One row per (t, rank of group 0)."""
    out = launch_named(_measure_body, WORLD, ulysses_attention, ring_attention_forward, zigzag_shard, tuple(ts),
                       seq, name="measure", timeout=timeout)
    rows = []
    for t in ts:
        for rank_rows in out[:t]:            # group 0 is ranks 0..t-1
            row = next(x for x in rank_rows if x["t"] == t)
            fwd = lambda colls: sum(c.nbytes for c in colls if c.phase == "forward")     # noqa: E731
            row["ulysses_theory"] = fwd(cost.ulysses_collectives(B, seq, H, D, t))
            row["ring_theory"] = fwd(cost.ring_attention_messages(B, seq, H, D, t))
            for layout in ("contiguous", "zigzag"):
                row[f"{layout}_formula"] = cost.causal_scores(seq, t, layout == "zigzag")[row["rank"]] * B * H
            rows.append(row)
    return rows
