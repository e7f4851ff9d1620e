"""``minidist tour`` rows for lecture 11: overlapping communication with computation.

Each row runs an overlapped technique and its plain version on 4 ranks in one launch, from the
same inputs: ``max_err`` is the largest difference of their outputs and gradients (of the
trained parameters for FSDP); ``bytes_per_rank`` is the payload the busiest rank's overlapped
version sent (the tracer's count) next to its formula; the row's own ``passed`` also requires
that the trace shows each overlapped transfer issued before the computation it overlaps. The
note gives the time each version waited on communication (exposed, ``minidist.trace.timeline``),
one step on shared cores: an illustration; ``minidist bench overlap`` measures it over steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist.cost.overlap import prefetch_extra_bytes, ring_bytes
from minidist.data_parallel import BucketedDDP, FullyShardedDataParallel
from minidist.memory import peak_bytes
from minidist.overlap import all_gather_matmul, matmul_reduce_scatter
from minidist.runtime import device, launch, timed
from minidist.tensor_parallel import reduce_scatter_along_dim, sequence_parallel_linear
from minidist.tour import TourEntry
from minidist.trace import merge, span, trace
from minidist.trace.timeline import exposed

T = 4
B, ROWS, D_IN, D_OUT, WIDTH = 2, 4, 32, 48, 64


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(device())


def _err(a, b) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def _step(fn, inputs, dy):
    """Forward and backward of ``fn`` on copies of ``inputs`` under a trace: (output and grads, trace)."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    with trace() as t:
        y = fn(*leaves)
        (y * dy).sum().backward()
    return [y.detach()] + [x.grad for x in leaves], t


def _issued_before(t, computes, in_flight_ops) -> bool:
    """Every one of ``computes`` began while an op of ``in_flight_ops`` issued before it was unfinished."""
    ops = [e for e in t.comm() if e.op in in_flight_ops]
    return all(any(e.start < c.start < e.end for e in ops) for c in computes)


# ----------------------------------------------------------------------------- asynchronous TP
def _ring_rank(which: str):
    rank = dist.get_rank()
    if which == "all-gather":
        inputs, dy = [_x(B, ROWS, D_IN, seed=rank), _x(D_OUT, D_IN, seed=10), _x(D_OUT, seed=11)], _x(B, ROWS * T,
                                                                                                      D_OUT, seed=12)
        ring, plain = all_gather_matmul, sequence_parallel_linear
        skip = lambda i, step: step == (T - 1 if i < 2 * T else 0)     # noqa: E731  (steps with no message)
    else:
        inputs, dy = [_x(B, ROWS * T, D_IN, seed=rank), _x(D_OUT, D_IN, seed=20 + rank)], _x(B, ROWS, D_OUT, seed=30)
        ring, plain = matmul_reduce_scatter, lambda x, w: reduce_scatter_along_dim(F.linear(x, w), 1)
        skip = lambda i, step: step == (0 if i < T else T - 1)         # noqa: E731
    _step(ring, inputs, dy), _step(plain, inputs, dy)           # warm-up: gloo connects pairs on first use
    ours, t = _step(ring, inputs, dy)
    ref, t_plain = _step(plain, inputs, dy)
    matmuls = sorted((e for e in t.events if e.op == "compute:matmul"), key=lambda e: e.start)
    overlapped = [m for i, m in enumerate(matmuls) if not skip(i, m.meta["step"])]
    return {"err": _err(ours, ref), "sent": t.bytes_sent(), "ordered": _issued_before(t, overlapped, {"isend", "irecv"}),
            "exposed": (exposed(t, rank), exposed(t_plain, rank))}


def _ring_row(which: str) -> dict:
    with timed() as clock:
        out = launch(_ring_rank, T, which, timeout=120)
    theory = (3 * ring_bytes(B * ROWS * D_IN * 4, T) if which == "all-gather"
              else 2 * ring_bytes(B * ROWS * D_OUT * 4, T))
    ring_ms, plain_ms = (1e3 * max(o["exposed"][k] for o in out) for k in (0, 1))
    name = "all-gather + matmul" if which == "all-gather" else "matmul + reduce-scatter"
    return {"technique": f"overlap: TP ring {name}", "world_size": T, "max_err": max(o["err"] for o in out),
            "bytes_per_rank": max(o["sent"] for o in out), "bytes_theory": theory, "time_s": clock.seconds,
            "passed": all(o["ordered"] for o in out) and all(o["sent"] == theory for o in out),
            "note": (f"vs the plain collective + matmul, forward and backward; every message issued before the "
                     f"matmul it overlaps: {all(o['ordered'] for o in out)}; waited {ring_ms:.1f} ms (ring) vs "
                     f"{plain_ms:.1f} ms (plain), busiest rank, one step")}


# ----------------------------------------------------------------------------- data parallelism
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, device=device()) for _ in range(4)])


def _ddp_rank(overlap: bool):
    rank = dist.get_rank()
    model = _mlp()
    ddp = BucketedDDP(model, bucket_cap_bytes=(WIDTH + 1) * WIDTH * 4, overlap=overlap)

    def last_gradient(p):           # runs after the DDP hook of the same parameter: the end of backward's work
        with span("first layer's gradient ready"):
            pass

    model[0].weight.register_post_accumulate_grad_hook(last_gradient)
    x = _x(8, WIDTH, seed=rank)
    F.mse_loss(ddp(x), x).backward()                             # warm-up
    model.zero_grad()
    with trace() as t:
        F.mse_loss(ddp(x), x).backward()
    ready = next(e.start for e in t.events if e.op == "span:first layer's gradient ready")
    launches = sorted(e.start for e in t.comm() if e.op == "all_reduce")
    return [p.grad for p in ddp.parameters()], t, launches[0] < ready, sum(e.nbytes for e in t.comm())


def _ddp_row() -> dict:
    with timed() as clock:
        out = launch(lambda: (_ddp_rank(True), _ddp_rank(False)), T, timeout=120)
    numel = 4 * (WIDTH * WIDTH + WIDTH)
    waited = [max(exposed(merge(o[i][1] for o in out), r) for r in range(T)) * 1e3 for i in (0, 1)]
    during = all(o[0][2] for o in out) and not any(o[1][2] for o in out)
    return {"technique": "overlap: DDP buckets during backward", "world_size": T,
            "max_err": max(_err(o[0][0], o[1][0]) for o in out), "bytes_per_rank": max(o[0][3] for o in out),
            "bytes_theory": 4 * numel, "time_s": clock.seconds, "passed": during,
            "note": (f"vs every bucket after backward (overlap=False); first all-reduce launched before the last "
                     f"gradient only with overlap: {during}; waited {waited[0]:.1f} ms (overlap) vs {waited[1]:.1f} ms, "
                     f"busiest rank, one step")}


def _fsdp_rank(prefetch: bool):
    f = FullyShardedDataParallel(_mlp(), optimizer_cls=torch.optim.SGD, prefetch=prefetch, lr=0.1)
    x, y = _x(8, WIDTH, seed=dist.get_rank()), _x(8, WIDTH, seed=99)

    def step():
        F.mse_loss(f(x), y).backward()
        f.step()
        f.zero_grad()

    step()                          # learns the units' order
    with trace() as t:
        step()
    _, peak, _ = peak_bytes(lambda: F.mse_loss(f(x), y))
    spans = sorted((e for e in t.events if e.op.startswith("compute:")), key=lambda e: e.start)
    ordered = all(_issued_before(t, [s for s in spans if s.op == f"compute:{phase}"][:-1], {"all_gather_into_tensor"})
                  for phase in ("forward", "backward"))
    with f.summon_full_params():
        params = [p.detach().clone() for p in f.module.parameters()]
    return params, t, ordered, peak, [u._bytes for u in f.units]


def _fsdp_row() -> dict:
    with timed() as clock:
        out = launch(lambda: (_fsdp_rank(True), _fsdp_rank(False)), T, timeout=120)
    units = out[0][0][4]
    theory = sum(2 * b // T + b for b in units)      # per step: two all-gathers of a shard, a reduce-scatter of all
    waited = [max(exposed(merge(o[i][1] for o in out), r) for r in range(T)) * 1e3 for i in (0, 1)]
    extra = max(o[0][3] - o[1][3] for o in out)
    ordered = all(o[0][2] for o in out) and not any(o[1][2] for o in out)
    return {"technique": "overlap: FSDP prefetch, forward and backward", "world_size": T,
            "max_err": max(_err(o[0][0], o[1][0]) for o in out),
            "bytes_per_rank": max(sum(e.nbytes for e in o[0][1].comm()) for o in out), "bytes_theory": theory,
            "time_s": clock.seconds, "passed": ordered,
            "note": (f"vs no prefetch; next unit's all-gather in flight as each unit computes: {ordered}; forward "
                     f"peak +{extra} B vs formula +{prefetch_extra_bytes(units):.0f} B (one unit); waited "
                     f"{waited[0]:.1f} ms (prefetch) vs {waited[1]:.1f} ms, busiest rank, one step")}


def tour_entries() -> list[TourEntry]:
    return [TourEntry("overlap: TP ring all-gather + matmul", T, lambda: _ring_row("all-gather"), tolerance=1e-5),
            TourEntry("overlap: TP ring matmul + reduce-scatter", T, lambda: _ring_row("reduce-scatter"),
                      tolerance=1e-5),
            TourEntry("overlap: DDP buckets during backward", T, _ddp_row),
            TourEntry("overlap: FSDP prefetch, forward and backward", T, _fsdp_row)]
