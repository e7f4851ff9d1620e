"""MoE dispatch and combine: time and traced bytes vs the formula by token count and EP size, and torch's all-to-all.

One launch of max(--ep) ranks; an EP group of e is a block of e consecutive ranks (the
other blocks run the same at the same time). Every rank routes its T tokens (fp32, hidden
h) with a round-robin router (token t's choice j is expert (t + j + rank) mod E: every
expert gets T·k/E rows from every rank, the balanced case the formula assumes), then per
step, after a barrier: ``ep_dispatch`` (counts, then the rows), ``ep_combine`` (the rows
back, weighted), and backward through both; and, as the reference for the exchange itself,
one ``torch.distributed.all_to_all_single`` of the same rows with the same splits. Times
are the slowest rank's, median over steps. Bytes are the payloads the tracer saw on rank 0
in one step (forward and backward), next to ``minidist.cost.ep_layer_collectives``;
``wire_theory`` is the (e−1)/e of them that leaves the rank. Tensors live on
``minidist.device()``; times go through ``minidist.timed``.
"""
from __future__ import annotations

import statistics


def add_arguments(parser):
    parser.add_argument("--tokens", default="256,1024,4096", help="comma-separated tokens per rank")
    parser.add_argument("--ep", default="2,4", help="comma-separated expert-parallel sizes (ranks: the largest)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per size")
    parser.add_argument("--warmup", type=int, default=1)


def _groups(sizes):
    """{e: this rank's block of e consecutive ranks} (every rank creates every group)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for e in sizes:
        for start in range(0, world, e):
            members = list(range(start, start + e))
            group = None if e == world else dist.new_group(members)
            if rank in members:
                out[e] = group
    dist.barrier()
    return out


def _one_size(group, tokens, hidden, experts, k, steps, warmup):
    import torch
    import torch.distributed as dist

    from minidist.expert_parallel import ep_combine, ep_dispatch
    from minidist.runtime import device, timed
    from minidist.trace import trace
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g, device="cpu").to(device()).requires_grad_()
    w = torch.rand(tokens, k, generator=g, device="cpu").to(device())
    indices = torch.stack([(torch.arange(tokens, device=device()) + j + rank) % experts for j in range(k)], 1)
    times = {"dispatch": [], "combine": [], "backward": [], "torch_a2a": []}
    sent = None
    for step in range(warmup + steps):
        dist.barrier()
        with trace() as t:
            with timed() as d:
                rows, plan = ep_dispatch(x, indices, experts, group=group)
            with timed() as c:
                y = ep_combine(rows, w, plan, group=group)
            with timed() as b:
                y.sum().backward()
        send = x.detach()[plan.token_index]
        out = torch.empty(sum(plan.recv_splits), hidden, device=device())
        dist.barrier()
        with timed() as ref:
            dist.all_to_all_single(out, send, plan.recv_splits, plan.send_splits, group=group)
        if step == 0:
            sent = sum(e.nbytes for e in t.comm() if e.op == "all_to_all_single")
        if step >= warmup:
            for name, clock in (("dispatch", d), ("combine", c), ("backward", b), ("torch_a2a", ref)):
                times[name].append(clock.seconds)
        x.grad = None
    return times, sent


def _bench(eps, token_counts, hidden, experts, k, steps, warmup):
    groups = _groups(eps)
    return {(e, tokens): _one_size(groups[e], tokens, hidden, experts, k, steps, warmup)
            for e in eps for tokens in token_counts}


def run(args) -> list[dict]:
    from minidist import cost
    from minidist.runtime import launch
    eps = sorted({int(e) for e in args.ep.split(",")})
    token_counts = [int(t) for t in args.tokens.split(",")]
    world = max(eps)
    if any(world % e for e in eps) or min(eps) < 2:
        raise ValueError(f"--ep sizes {eps} must be >= 2 and divide the largest ({world})")
    if any(args.experts % e for e in eps) or not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--experts {args.experts} must be divisible by every --ep size and >= --top-k {args.top_k}")
    steps = max(args.steps, 1)
    out = launch(_bench, world, eps, token_counts, args.hidden, args.experts, args.top_k, steps,
                 max(args.warmup, 1), timeout=600)
    rows = []
    for e in eps:
        for tokens in token_counts:
            ms = {name: 1e3 * statistics.median(max(o[(e, tokens)][0][name][i] for o in out) for i in range(steps))
                  for name in ("dispatch", "combine", "backward", "torch_a2a")}
            theory = cost.ep_bytes_per_rank(tokens, args.hidden, args.top_k, args.experts, e)
            traced = out[0][(e, tokens)][1]
            rows.append({"ep": e, "tokens": tokens, "hidden": args.hidden, "top_k": args.top_k,
                         "dispatch_ms": ms["dispatch"], "combine_ms": ms["combine"], "backward_ms": ms["backward"],
                         "torch_a2a_ms": ms["torch_a2a"], "bytes_per_rank": traced, "bytes_theory": theory["total"],
                         "wire_theory": theory["wire"], "equal": traced == theory["total"]})
    return rows
