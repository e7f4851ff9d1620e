"""``minidist tour`` rows for context parallelism: DeepSpeed-Ulysses and ring attention.

Each row runs one attention forward and backward on 4 CPU ranks (fp32), each rank on its
sequence shard of q, k, v built from the same seed, next to single-process
``scaled_dot_product_attention`` in fp64 on the same (fp32-rounded) inputs. It reports the
largest difference of the output and of dq, dk, dv (max_err, relative to the largest
reference value where that exceeds 1), the payload bytes the tracer saw on the busiest
rank next to ``minidist.cost.context_parallel`` (bytes_per_rank vs bytes_theory), and for
causal rows the per-rank attention work (unmasked scores, from the kernel's trace spans)
as most-loaded over mean. A row's own ``passed`` says the traced bytes equal theory (and,
for zigzag, that the work is balanced within 5%); the tour judges max_err. Inputs are drawn
on the CPU and moved to the rank's device, ``minidist.device()``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import cost
from minidist.context_parallel import ring_attention, shard, ulysses_attention
from minidist.runtime import device, launch, timed
from minidist.tour import TourEntry
from minidist.trace import trace

P = 4
B, S, H, D = 2, 64, 8, 16


def _err(a, b) -> float:
    return ((a.detach().double() - b.detach().double()).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _rank(kind, n_kv, causal, zigzag):
    r, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    draw = lambda h: torch.randn(B, S, h, D, generator=g, device="cpu").to(device(), torch.float64)  # noqa: E731
    q, w = draw(H), draw(H)
    k, v = draw(n_kv), draw(n_kv)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in full), is_causal=causal,
                                         enable_gqa=True).transpose(1, 2)
    (ref * w).sum().backward()
    cut = lambda x: shard(x, r, p, zigzag).float()              # noqa: E731
    mine = [cut(x).requires_grad_() for x in (q, k, v)]
    with trace() as fwd:
        if kind == "ring":
            out = ring_attention(*mine, causal, zigzag=zigzag)
        else:
            out = ulysses_attention(*mine, causal)
    with trace() as bwd:
        (out * cut(w)).sum().backward()
    err = max([_err(out, cut(ref))] + [_err(x.grad, cut(f.grad)) for x, f in zip(mine, full)])
    sent = sum(e.nbytes for t in (fwd, bwd) for e in t.comm() if e.op in ("isend", "all_to_all_single"))
    work = sum(e.meta["unmasked"] for e in fwd.events if e.op == "span:attention block")     # forward's scores
    return err, sent, work


ROWS = {   # label: (kind, kv heads, causal, zigzag)
    "CP Ulysses attention (8 heads)": ("ulysses", 8, False, False),
    "CP Ulysses, GQA 8q/4kv (kv split)": ("ulysses", 4, False, False),
    "CP Ulysses, MQA 8q/1kv (kv replicated x4)": ("ulysses", 1, False, False),
    "CP ring attention (8 heads)": ("ring", 8, False, False),
    "CP ring attention, GQA 8q/2kv": ("ring", 2, False, False),
    "CP causal ring attention, contiguous shards": ("ring", 8, True, False),
    "CP causal ring attention, zigzag shards": ("ring", 8, True, True),
}


def _theory(kind, n_kv):
    if kind == "ring":
        return cost.ring_attention_messages(B, S, n_kv, D, P)
    return cost.ulysses_collectives(B, S, H, D, P, h_kv=n_kv)


def tour_row(label: str) -> dict:
    kind, n_kv, causal, zigzag = ROWS[label]
    with timed() as clock:
        out = launch(_rank, P, kind, n_kv, causal, zigzag, timeout=120)
    theory = cost.tp_payload_bytes(_theory(kind, n_kv))
    row = {"technique": label, "world_size": P, "max_err": max(o[0] for o in out),
           "bytes_per_rank": max(o[1] for o in out), "bytes_theory": theory, "time_s": clock.seconds}
    row["passed"] = row["bytes_per_rank"] == theory and len({o[1] for o in out}) == 1
    if kind == "ulysses":
        row["note"] = "4 all-to-alls forward, 4 backward" + ("; kv heads replicated to P" if n_kv % P else "")
    else:
        row["note"] = f"{P - 1} kv passes forward; {P - 1} kv + {P} dkv passes backward; neighbours only"
    if causal:
        work = [o[2] for o in out]
        spread = cost.imbalance(work)
        row["work_imbalance"] = spread
        formula = cost.imbalance(cost.causal_scores(S, P, zigzag))
        row["note"] += f"; causal work max/mean {spread:.2f} (formula {formula:.2f})"
        row["passed"] = row["passed"] and work == cost.causal_scores(S, P, zigzag) and (not zigzag or spread <= 1.05)
    return row


def tour_entries() -> list[TourEntry]:
    return [TourEntry(label, P, lambda k=label: tour_row(k)) for label in ROWS]
