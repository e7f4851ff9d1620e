"""All-reduce algorithms vs torch.distributed's native one: time, algbw, busbw (nccl-tests style).

Measurement, as in nccl-tests: for each size, every algorithm runs a few warm-up calls,
then ``iters`` timed calls, each started after a barrier; a call's time is the slowest
rank's (the collective is done when the last rank is done) and a row reports the median
over calls. Algorithms are interleaved call by call, not run one after another, so a
burst of load on a shared machine hits all of them alike.

Buffers, as in nccl-tests: native ``dist.all_reduce`` runs in place on a preallocated
buffer and ``fast_ring`` writes into a preallocated ``out=``, so neither pays for fresh
memory (page faults cost ~1 ms per MiB on this VM); the other algorithms allocate their
result, as their API does, which is part of why they are slower at large sizes.

algbw = S / t; busbw = algbw · 2(N-1)/N, the nccl-tests factor for all-reduce, which
reads as the speed of one link and does not depend on N (nccl-tests PERFORMANCE.md).
α and β of the α-β model are fitted by least squares to all minidist rows at once
(each algorithm with its own coefficients from ``minidist.cost.allreduce_terms``) and
every row shows the model's prediction next to the measurement.

torch is imported where the work starts, not at the top: ``minidist bench collectives --help``
answers without it (``minidist bench cli`` measures that).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from minidist.units import byte_list_arg, parse_bytes, positive_int_arg

NATIVE = "native"
#: the keys of ``minidist.collectives.ALL_REDUCES``, named here so that --help needs no torch
#: (tests/test_cli.py checks that the two agree)
ALGORITHMS = ("parameter_server", "naive", "parallel", "tree", "ring", "recursive_halving", "fast_ring")
DEFAULT_ALGORITHMS = [NATIVE, "ring", "fast_ring", "recursive_halving", "tree", "naive", "parameter_server", "parallel"]
parse_size = parse_bytes      # '64K' -> 65536 (K, M, G binary, as nccl-tests; KB = 1000, KiB = 1024)


def _algorithm_list(text: str) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a != NATIVE and a not in ALGORITHMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown algorithm {', '.join(unknown) or repr(text)}; "
                                         f"choose from {NATIVE},{','.join(ALGORITHMS)}")
    return names


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=positive_int_arg, default=4)
    parser.add_argument("--sizes", type=byte_list_arg, default="1K,64K,1M,16M",
                        help="bytes per rank, comma-separated: 1K = 1KiB = 1024, 1KB = 1000, 16MiB")
    parser.add_argument("--algorithms", type=_algorithm_list, default=",".join(DEFAULT_ALGORITHMS),
                        help=f"comma-separated, from {NATIVE},{','.join(ALGORITHMS)}")
    parser.add_argument("--iters", type=positive_int_arg, default=None, help="timed calls per size (default: by size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--plot", default=None, metavar="PATH", help="save busbw vs size with the fitted model")


def _iters_for(nbytes: int) -> int:
    return 40 if nbytes <= 64 << 10 else 15 if nbytes <= 1 << 20 else 9


def _measure(sizes, algorithms, iters, warmup, functions):
    """Runs on every rank: {(algorithm, size): [seconds per call]} of this rank."""
    import torch
    import torch.distributed as dist

    import minidist
    from minidist.collectives import ALL_REDUCES
    times = {}
    for nbytes in sizes:
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(max(1, nbytes // 4), generator=g, device="cpu").to(minidist.device())
        inplace, out = x.clone(), torch.zeros_like(x)        # preallocated and touched: no page faults timed
        fns = {a: functions.get(a) or ALL_REDUCES[a] for a in algorithms if a != NATIVE}
        fns[NATIVE] = lambda x: dist.all_reduce(inplace)
        if "fast_ring" in fns and "fast_ring" not in functions:
            fns["fast_ring"] = lambda x: ALL_REDUCES["fast_ring"](x, out=out)
        for _ in range(warmup):
            for a in algorithms:
                inplace.copy_(x)
                fns[a](x)
        for _ in range(iters or _iters_for(nbytes)):
            for a in algorithms:                    # interleaved: see the module docstring
                inplace.copy_(x)                    # native sums in place: restore its input, untimed
                dist.barrier()
                with minidist.timed() as t:
                    fns[a](x)
                times.setdefault((a, nbytes), []).append(t.seconds)
    return times


def measure(world_size=4, sizes=(1 << 10, 64 << 10, 1 << 20, 16 << 20), algorithms=DEFAULT_ALGORITHMS,
            iters=None, warmup=2, timeout=600.0, functions=None, models=None) -> list[dict]:
    """Benchmark rows (see the module docstring); the fit is in each row's model columns.

    ``functions`` adds your own all-reduces by name (e.g. ``{"my_ring": ring_all_reduce}``
    from a lab), measured in the same interleaved run; ``models`` names the cost model of
    each (``{"my_ring": "ring"}``) so that it joins the α-β fit.
    """
    import minidist
    from minidist import cost
    from minidist.collectives import ALL_REDUCES
    functions, models = dict(functions or {}), {a: a for a in ALL_REDUCES} | dict(models or {})
    algorithms = list(algorithms) + [f for f in functions if f not in algorithms]
    unknown = [a for a in algorithms if a != NATIVE and a not in ALL_REDUCES and a not in functions]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; known: {NATIVE}, {', '.join(ALL_REDUCES)}")
    if world_size < 2:
        raise ValueError("a collective benchmark needs --world-size >= 2")
    per_rank = minidist.launch(_measure, world_size, list(sizes), algorithms, iters, warmup, functions,
                               timeout=timeout)
    rows = []
    for (a, nbytes), first in per_rank[0].items():
        calls = [max(r[(a, nbytes)][i] for r in per_rank) for i in range(len(first))]
        t = statistics.median(calls)
        rows.append({"algorithm": a, "size": human(nbytes), "bytes": nbytes, "world_size": world_size,
                     "time_us": t * 1e6, "algbw_GBps": cost.algbw(nbytes, t) / 1e9,
                     "busbw_GBps": cost.busbw(nbytes, t, world_size) / 1e9})
    native = {r["bytes"]: r["busbw_GBps"] for r in rows if r["algorithm"] == NATIVE}
    modelled = [r for r in rows if r["algorithm"] in models]
    fit = cost.fit_alpha_beta([r["bytes"] for r in modelled], [r["time_us"] * 1e-6 for r in modelled],
                              algorithm=[models[r["algorithm"]] for r in modelled], n=world_size) \
        if len(modelled) >= 2 else None
    for r in rows:
        if r["bytes"] in native:
            r["vs_native"] = r["busbw_GBps"] / native[r["bytes"]]
        if fit is not None and r["algorithm"] in models:
            if models[r["algorithm"]] != r["algorithm"]:       # a user function timed against a model
                r["model"] = models[r["algorithm"]]
            r["model_us"] = cost.allreduce_time(models[r["algorithm"]], world_size, r["bytes"], fit.alpha, fit.beta) * 1e6
            r["alpha_us"], r["beta_GBps"] = fit.alpha * 1e6, (1 / fit.beta / 1e9 if fit.beta else float("inf"))
    order = {a: i for i, a in enumerate(algorithms)}
    rows.sort(key=lambda r: (r["bytes"], order[r["algorithm"]]))
    return rows


def run(args) -> list[dict]:
    rows = measure(args.world_size, args.sizes, args.algorithms, args.iters, args.warmup)
    fitted = next((r for r in rows if "alpha_us" in r), None)
    if fitted:
        print(f"fitted alpha-beta model: alpha = {fitted['alpha_us']:.1f} us, "
              f"1/beta = {fitted['beta_GBps']:.2f} GB/s", file=sys.stderr)
    if args.plot:
        from minidist.plots import plot_busbw
        plot_busbw(rows, path=args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)
    return rows
