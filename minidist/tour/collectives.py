"""``minidist tour`` rows for collectives: torch's own all-reduce as the baseline, then every
all-reduce of lecture 1 built from send/recv, each against the sum and its byte formula."""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.collectives import ALL_REDUCES
from minidist.cost import allreduce_bytes_per_rank
from minidist.runtime import device, launch, timed
from minidist.tour import TourEntry
from minidist.trace import trace


def _native_all_reduce(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
    with trace() as t:
        y = x.clone()
        dist.all_reduce(y)
    return x, y, sum(e.nbytes for e in t.comm())


def _run_native(world_size=4, numel=1 << 16):
    with timed() as elapsed:
        out = launch(_native_all_reduce, world_size, numel)
    reference = sum(x for x, _, _ in out)
    err = max((y - reference).abs().max().item() for _, y, _ in out)
    return {"technique": "all_reduce (torch native, baseline)", "world_size": world_size, "max_err": err,
            "bytes_per_rank": max(b for _, _, b in out), "bytes_theory": numel * 4, "time_s": elapsed.seconds,
            "note": "payload bytes handed to gloo; its algorithm is not traced"}


_THEORY = {"parameter_server": "rank 0: (N-1)·S", "naive": "rank 0: (N-1)·S", "parallel": "(N-1)·S",
           "tree": "root: ⌈lg N⌉·S", "ring": "2(N-1)/N·S", "fast_ring": "2(N-1)/N·S",
           "recursive_halving": "2(N-1)/N·S"}


def _tour_rank(name, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()), device="cpu").to(device())
    ALL_REDUCES[name](x)                                     # warm-up: connections, allocator
    dist.barrier()
    with trace() as t, timed() as elapsed:
        y = ALL_REDUCES[name](x)
    return x, y, t.bytes_sent(), elapsed.seconds


def tour_entries() -> list[TourEntry]:
    """The baseline, then one row per all-reduce variant: 4 ranks, 64 Ki float32 elements (256 KiB)."""

    def entry(name, n=4, numel=1 << 16):
        def run():
            out = launch(_tour_rank, n, name, numel)
            reference = torch.stack([x for x, *_ in out]).sum(0)
            theory = max(s for s, _ in allreduce_bytes_per_rank(name, n, numel, 4))
            return {"technique": f"all-reduce: {name}", "world_size": n,
                    "max_err": max((y - reference).abs().max().item() for _, y, *_ in out),
                    "bytes_per_rank": max(b for *_, b, _ in out), "bytes_theory": theory,
                    "time_s": max(t for *_, t in out),
                    "note": f"max over ranks of bytes sent; theory {_THEORY[name]}; time of one call"}
        return TourEntry(f"all-reduce: {name}", n, run)

    return [TourEntry("all_reduce (torch native)", 4, _run_native)] + [entry(name) for name in ALL_REDUCES]
