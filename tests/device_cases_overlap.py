"""Device-discipline cases for minidist.overlap (see tests/device_discipline.py): the ring schedules
and the decomposed collective matmuls, forward and backward, on 4 ranks, each compared with plain
torch ops in the same rank (every rank can form the whole reference: data drawn from known seeds)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from device_discipline import Case, assert_real
from minidist import overlap

WORLD = 4
B, ROWS, D_IN, D_OUT = 2, 2, 5, 3


def dev() -> torch.device:
    return minidist.device()


def randn(*shape, seed: int, grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(dev())
    return x.requires_grad_() if grad else x


def close(got, want, what="result", tol=1e-5):
    assert_real(got)
    assert got.device == want.device == dev(), f"{what} is on {got.device}, the inputs on {dev()}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got.detach() - want.detach()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g}"


def case_ring_all_gather_consume():
    rank, t = dist.get_rank(), dist.get_world_size()
    seen = {}
    overlap.ring_all_gather_consume(randn(B, ROWS, seed=rank), lambda c, x: seen.__setitem__(c, x.clone()))
    assert sorted(seen) == list(range(t))
    for c, x in seen.items():
        close(x, randn(B, ROWS, seed=c), f"shard {c}")


def case_ring_reduce_scatter_produce():
    rank, t = dist.get_rank(), dist.get_world_size()
    got = overlap.ring_reduce_scatter_produce(lambda c: randn(B, ROWS, seed=10 * rank + c))
    close(got, sum(randn(B, ROWS, seed=10 * r + rank) for r in range(t)))


def _all_gather_matmul(fn):
    rank, t = dist.get_rank(), dist.get_world_size()
    full = randn(B, ROWS * t, D_IN, seed=1, grad=True)
    w, b = randn(D_OUT, D_IN, seed=2, grad=True), randn(D_OUT, seed=3, grad=True)
    x = full.detach()[:, rank * ROWS:(rank + 1) * ROWS].clone().requires_grad_()
    w_ours, b_ours = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y, y_ref = fn(x, w_ours, b_ours), F.linear(full, w, b)
    close(y, y_ref)
    g = randn(B, ROWS * t, D_OUT, seed=4)
    y.backward(g)
    y_ref.backward(g * t)            # every rank's dx chunk is a sum over t ranks' identical partials
    close(x.grad, full.grad[:, rank * ROWS:(rank + 1) * ROWS], "input gradient")
    close(w_ours.grad * t, w.grad, "weight gradient")
    close(b_ours.grad * t, b.grad, "bias gradient")


def _matmul_reduce_scatter(fn):
    rank, t = dist.get_rank(), dist.get_world_size()
    xs = [randn(B, ROWS * t, D_IN, seed=20 + r) for r in range(t)]
    ws = [randn(D_OUT, D_IN, seed=30 + r) for r in range(t)]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    y = fn(x, w)
    close(y, sum(F.linear(a, b) for a, b in zip(xs, ws))[:, rank * ROWS:(rank + 1) * ROWS])
    gs = [randn(B, ROWS, D_OUT, seed=40 + r) for r in range(t)]
    y.backward(gs[rank])
    full_g = torch.cat(gs, 1)
    close(x.grad, full_g @ ws[rank], "input gradient")
    close(w.grad, full_g.flatten(0, 1).T @ xs[rank].flatten(0, 1), "weight gradient")


CASES = {f"minidist.overlap.{name}": Case(WORLD, body) for name, body in {
    "ring_all_gather_consume": case_ring_all_gather_consume,
    "ring_reduce_scatter_produce": case_ring_reduce_scatter_produce,
    "all_gather_matmul": lambda: _all_gather_matmul(overlap.all_gather_matmul),
    "AllGatherMatmul": lambda: _all_gather_matmul(lambda x, w, b: overlap.AllGatherMatmul.apply(x, w, b, 1, None)),
    "matmul_reduce_scatter": lambda: _matmul_reduce_scatter(overlap.matmul_reduce_scatter),
    "MatmulReduceScatter": lambda: _matmul_reduce_scatter(
        lambda x, w: overlap.MatmulReduceScatter.apply(x, w, 1, None)),
}.items()}

_CUDA_ONLY = ("torch's fused symmetric-memory ops exist for CUDA tensors only; on CPU ranks they refuse before "
              "allocating anything (tests/test_overlap.py), on GPUs tests/test_gpu.py runs them")
EXEMPT = {
    "minidist.overlap.neighbours": "group ranks of the ring: ints only",
    "minidist.overlap.fused_available": "reads a tensor's device and torch's registered ops: no tensor made",
    "minidist.overlap.fused_all_gather_matmul": _CUDA_ONLY,
    "minidist.overlap.fused_matmul_reduce_scatter": _CUDA_ONLY,
}
