"""The layout planner's time model against measured step times of DP × PP × TP layouts on this machine.

``minidist plan`` ranks layouts by a model (Narayanan et al. 2021's compute,
the 1F1B bubble (p-1)/m, α-β time per axis; :mod:`minidist.cost.planner`). This bench asks
whether that ranking holds where it can be checked: one launch of 8 ranks

1. fits the model's constants here, under the same load as the steps: α, β from
   point-to-point ping-pongs of 4 pairs at once (``cost.fit_alpha_beta``, one message
   T = α + Sβ) and each rank's matmul speed (FLOP/s, all ranks multiplying at once);
2. builds every layout's :class:`minidist.mesh.Trainer3D` on a small TinyGPT, then times
   their steps interleaved (layout after layout, each after a barrier), so a burst of
   load from elsewhere hits all layouts alike; a step's time is the slowest rank's,
   a layout's the median over steps;
3. feeds the fitted constants to ``cost.planner.step_time`` (one "node" of 8 ranks, MFU 1,
   the planner's 2-byte elements rescaled to the run's fp32 through β) and reports
   Spearman's ρ between the modelled and the measured order.

The planner knows nothing of Python's per-operation overhead, which dominates tiny
layers on CPU: ρ says how much of the order the model still explains here. On shared
cores it varies from run to run; it is reported as measured, never asserted. Tensors are
on the rank's device (``minidist.device()``), and every time goes through ``minidist.timed``.
"""
from __future__ import annotations

import statistics
import sys
from typing import TYPE_CHECKING

from minidist import cost                  # the cost models import no torch: --help stays fast
from minidist.cost import planner
from minidist.cost.tensor_parallel import Link

if TYPE_CHECKING:
    from minidist.models import GPTConfig

DEFAULT_LAYOUTS = "8x1x1,4x2x1,4x1x2,2x2x2,2x4x1,2x1x4,1x2x4,1x4x2"      # d x p x t
P2P_SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 4 << 20)


def add_arguments(parser) -> None:
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated DPxPPxTP, 8 ranks each")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=1)


def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    """"2x2x2,1x2x4" -> [(2, 2, 2), (1, 2, 4)]: (dp, pp, tp)."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"a layout is DPxPPxTP, e.g. 2x2x2; got {item!r}")
        out.append(tuple(int(p) for p in parts))
    return out


def ranks(values) -> list[float]:
    """1-based ranks, smallest first; tied values share the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a, b) -> float:
    """Spearman's ρ: Pearson's correlation of the two rank vectors (ties averaged)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("Spearman's rho needs two sequences of equal length >= 2")
    ra, rb = ranks(list(a)), ranks(list(b))
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    if var == 0:
        raise ValueError("Spearman's rho is undefined when one side has all values equal")
    return cov / var


def model_spec(cfg: GPTConfig) -> planner.ModelSpec:
    """The planner's view of a TinyGPT: its layers at 12h² + 13h and embedding + head at V·h each."""
    h = cfg.d_model
    return planner.ModelSpec(cfg.n_layers * (12 * h * h + 13 * h) + 2 * cfg.vocab * h, cfg.n_layers, h,
                             cfg.n_heads, cfg.seq_len)


def model_time(cfg: GPTConfig, layout, *, batch: int, micro_batches: int, alpha: float, beta: float,
               flops: float, elem_bytes: int = 4) -> dict:
    """``cost.planner.step_time`` of ``layout`` = (dp, pp, tp) on one node of dp·pp·tp ranks with the fitted
    α (s), β (s/byte) and per-rank FLOP/s; the planner counts ``planner.ELEM``-byte elements, so β is
    scaled to ``elem_bytes``. No overlap is counted: ``Trainer3D`` all-reduces its gradients after
    backward and runs TP's collectives blocking, so nothing of what it sends is hidden."""
    dp, pp, tp = layout
    link = Link("fitted here", alpha, 1.0 / (beta * elem_bytes / planner.ELEM) if beta > 0 else float("inf"))
    n = dp * pp * tp
    cluster = planner.Cluster(n, n, float("inf"), peak_flops=flops, mfu=1.0, intra=link, inter=link)
    plan = planner.Plan(dp, pp, tp, 1, batch // (dp * micro_batches), micro_batches)
    times, _ = planner.step_time(model_spec(cfg), cluster, plan, global_batch=batch, recompute="none",
                                 sequence_parallel=False, overlap=())
    return times


# ---------------------------------------------------------------------------------- on the ranks
def _p2p(sizes, reps):
    """Ping-pong with the neighbour (0-1, 2-3, ...), all pairs at once: {bytes: [one-way seconds]}."""
    import torch
    import torch.distributed as dist

    from minidist.runtime import device, timed
    rank = dist.get_rank()
    peer = rank ^ 1
    out = {}
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), device=device())
        out[nbytes] = []
        for _ in range(reps):
            dist.barrier()
            with timed() as clock:
                if rank % 2 == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            out[nbytes].append(clock.seconds / 2)
    return out


def _matmul_flops(m, k, n, reps=5, inner=20):
    """FLOP/s of this rank's (m, k) @ (k, n), all ranks at once; ``inner`` products per timing so that
    a timing spans several scheduler slices of the shared cores, as a training step does."""
    import torch
    import torch.distributed as dist

    from minidist.runtime import device, timed
    a, b = torch.randn(m, k, device=device()), torch.randn(k, n, device=device())
    a @ b
    times = []
    for _ in range(reps):
        dist.barrier()
        with timed() as clock:
            for _ in range(inner):
                a @ b
        times.append(clock.seconds)
    return 2 * m * k * n * inner / statistics.median(times)


def _measure(cfg, layouts, batch, micro_batches, schedule, steps, warmup):
    import torch.distributed as dist

    from minidist.mesh import Trainer3D
    from minidist.models import TinyGPT, gpt_batch
    from minidist.runtime import timed
    p2p = _p2p(P2P_SIZES, 9)
    flops = _matmul_flops(batch * cfg.seq_len // 2, cfg.d_model, 4 * cfg.d_model)
    trainers = [Trainer3D(TinyGPT(cfg), dp, pp, tp, batch=batch, micro_batches=micro_batches, schedule=schedule,
                          optimizer="adam", lr=1e-3) for dp, pp, tp in layouts]
    step_s = [[] for _ in layouts]
    for step in range(warmup + steps):
        ids, targets = gpt_batch(step, batch, cfg.seq_len, cfg.vocab)
        for i, trainer in enumerate(trainers):
            dist.barrier()
            with timed() as clock:
                trainer.step(ids, targets)
            if step >= warmup:
                step_s[i].append(clock.seconds)
    return {"p2p": p2p, "flops": flops, "step_s": step_s}


def measure(cfg: GPTConfig, layouts, *, batch: int, micro_batches: int = 2, schedule: str = "1f1b", steps: int = 5,
            warmup: int = 1, timeout: float = 600) -> list[dict]:
    """One launch: the fit and every layout's steps; one row per layout, fastest measured first."""
    from minidist.mesh import check_3d
    from minidist.runtime import launch
    layouts = [tuple(x) for x in layouts]
    worlds = {dp * pp * tp for dp, pp, tp in layouts}
    if len(worlds) != 1 or len(layouts) < 2:
        raise ValueError(f"need >= 2 layouts of one world size, got {layouts}")
    for dp, pp, tp in layouts:             # every size refused before any rank starts
        check_3d(cfg, dp * pp * tp, dp, pp, tp, batch=batch, micro_batches=micro_batches, schedule=schedule)
    out = launch(_measure, worlds.pop(), cfg, layouts, batch, micro_batches, schedule, steps, warmup, timeout=timeout)
    sizes = sorted(out[0]["p2p"])
    one_way = [statistics.median(max(o["p2p"][s][i] for o in out) for i in range(len(out[0]["p2p"][s])))
               for s in sizes]
    fit = cost.fit_alpha_beta(sizes, one_way)
    flops = statistics.median(o["flops"] for o in out)
    measured = [statistics.median(max(o["step_s"][i][k] for o in out) for k in range(steps))
                for i in range(len(layouts))]
    modelled = [model_time(cfg, x, batch=batch, micro_batches=micro_batches, alpha=fit.alpha, beta=fit.beta,
                           flops=flops) for x in layouts]
    rho = spearman([t["total"] for t in modelled], measured)
    r_meas, r_model = ranks(measured), ranks([t["total"] for t in modelled])
    rows = []
    for i, (dp, pp, tp) in enumerate(layouts):
        t = modelled[i]
        rows.append({"layout": f"{dp}x{pp}x{tp}", "m": micro_batches, "measured_ms": 1e3 * measured[i],
                     "model_ms": 1e3 * t["total"], "measured_rank": r_meas[i], "model_rank": r_model[i],
                     "model_compute_ms": 1e3 * (t["compute"] + t["bubble"]),
                     "model_comm_ms": 1e3 * (t["tp"] + t["pp"] + t["dp"]),
                     "alpha_us": fit.alpha * 1e6, "beta_GBps": 1 / fit.beta / 1e9 if fit.beta else float("inf"),
                     "gflops_per_rank": flops / 1e9, "spearman_rho": rho})
    return sorted(rows, key=lambda r: r["measured_rank"])


def run(args) -> list[dict]:
    from minidist.models import GPTConfig
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
                    seq_len=args.seq)
    rows = measure(cfg, parse_layouts(args.layouts), batch=args.batch, micro_batches=args.micro_batches,
                   schedule=args.schedule, steps=args.steps, warmup=args.warmup)
    r = rows[0]
    print(f"fitted here: alpha = {r['alpha_us']:.1f} us, 1/beta = {r['beta_GBps']:.2f} GB/s, "
          f"{r['gflops_per_rank']:.2f} GFLOP/s per rank; Spearman rho (model vs measured order) = "
          f"{r['spearman_rho']:.2f} over {len(rows)} layouts", file=sys.stderr)
    return rows
