"""Ulysses vs ring attention (with and without overlap): step time and bytes vs sequence length.

One causal attention forward + backward per step on sequence shards (b, s/P, h, d), fp32,
CPU gloo: ``ulysses_attention`` (contiguous shards), and ``ring_attention`` on zigzag
shards with ``overlap=True`` (each block's isend/irecv posted before its compute and
waited for after) and ``overlap=False`` (waited for before the compute). The
implementations take alternate steps after a barrier, so load from other processes hits
all alike; a step ends when the slowest rank ends (max over ranks, then median over
steps). Bytes are the payloads the tracer saw on rank 0 in one step, next to
``minidist.cost.context_parallel``. ``overlap_saving`` is 1 − ring(overlap) / ring(no
overlap): what sending the next block during this block's compute buys on this machine;
``pass_ms`` (one isend of a K/V or dK/dV block, posted to completed) and ``block_ms`` (one
block's attention compute), medians from the traced no-overlap ring, say how much there is
to hide: at most min(pass, block) per step. Inputs live on the rank's device
(``minidist.device()``); step times go through ``minidist.timed``.
"""
from __future__ import annotations

import statistics

IMPLS = ("ulysses", "ring, overlap", "ring, no overlap")


def _attention(name: str, q, k, v):
    from minidist.context_parallel import ring_attention, ulysses_attention    # torch: not for --help
    if name == "ulysses":
        return ulysses_attention(q, k, v, True)
    return ring_attention(q, k, v, True, zigzag=True, overlap=name == "ring, overlap")


def add_arguments(parser):
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seqs", default="512,1024,2048", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA: fewer key/value heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=1)


def _inputs(name, seq, heads, kv_heads, head_dim, batch):
    import torch
    import torch.distributed as dist

    from minidist.context_parallel import shard
    from minidist.runtime import device
    r, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    zigzag = name.startswith("ring")
    draw = lambda h: torch.randn(batch, seq, h, head_dim, generator=g, device="cpu").to(device())  # noqa: E731
    q = shard(draw(heads), r, p, zigzag)
    k, v = (shard(draw(kv_heads), r, p, zigzag) for _ in range(2))
    return [x.contiguous().requires_grad_() for x in (q, k, v)]


def _step(name, inputs):
    from minidist.runtime import timed
    with timed() as clock:
        _attention(name, *inputs).sum().backward()
    return clock.seconds


def _bench(seq, heads, kv_heads, head_dim, batch, steps, warmup):
    import torch.distributed as dist

    from minidist.trace import trace
    inputs = {name: _inputs(name, seq, heads, kv_heads, head_dim, batch) for name in IMPLS}
    times, sent, parts = {name: [] for name in IMPLS}, {}, {"pass": [], "block": []}
    for step in range(warmup + steps):
        for name in IMPLS:
            dist.barrier()
            with trace() as t:
                took = _step(name, inputs[name])
            if step == 0:
                sent[name] = sum(e.nbytes for e in t.comm() if e.op in ("isend", "all_to_all_single"))
            elif step >= warmup:
                times[name].append(took)
                if name == "ring, no overlap":     # what overlap could hide: a pass vs a block's compute
                    parts["pass"] += [e.end - e.start for e in t.events if e.op == "isend"]
                    parts["block"] += [e.end - e.start for e in t.events if e.op == "span:attention block"]
    return times, sent, {k: statistics.median(v) for k, v in parts.items()}


def run(args) -> list[dict]:
    from minidist import cost
    from minidist.runtime import launch
    p, kv = args.world_size, args.kv_heads or args.heads
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        out = launch(_bench, p, seq, args.heads, kv, args.head_dim, args.batch, args.steps,
                     max(args.warmup, 1), timeout=600)
        theory = {"ulysses": cost.ulysses_collectives(args.batch, seq, args.heads, args.head_dim, p, h_kv=kv),
                  "ring": cost.ring_attention_messages(args.batch, seq, kv, args.head_dim, p)}
        step = {name: statistics.median(max(o[0][name][i] for o in out) for i in range(args.steps))
                for name in IMPLS}
        ring_parts = {k: statistics.median(o[2][k] for o in out) for k in ("pass", "block")} if p > 1 else {}
        for name in IMPLS:
            ring = name.startswith("ring")
            rows.append({"impl": name, "world_size": p, "seq": seq, "step_ms": 1e3 * step[name],
                         "bytes_per_rank": out[0][1][name],
                         "bytes_theory": cost.tp_payload_bytes(theory[name.split(",")[0]]),
                         "pass_ms": 1e3 * ring_parts["pass"] if ring and ring_parts else None,
                         "block_ms": 1e3 * ring_parts["block"] if ring and ring_parts else None,
                         "overlap_saving": (1 - step[name] / step["ring, no overlap"]) if name == "ring, overlap"
                         else None})
    return rows
