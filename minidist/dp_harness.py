"""One training loop for every data-parallel variant, checked against the reference.

Used by the tests, ``minidist tour`` and the benchmarks, so that all of them compare
the same thing: N ranks, each on its 1/N slice of the global batch (optionally split
into micro-batches), versus :func:`minidist.models.train_reference` on the whole batch.

How traffic is counted: the tracer records a collective's *payload* (the input tensor
handed to gloo: the full vector for all_reduce and reduce_scatter_tensor, the shard for
all_gather_into_tensor), not gloo's wire traffic. :func:`ring_wire_bytes` turns a
payload into the bytes a rank sends with the bandwidth-optimal ring algorithm, which is
what the lecture's 2(N−1)/N·Ψ refers to; point-to-point sends count as sent.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from minidist.data_parallel import BucketedDDP, NaiveDDP, ParameterServer, group_rank_size
from minidist.fsdp import FullyShardedDataParallel
from minidist.memory import model_state_bytes, peak_bytes
from minidist.models import TinyMLP, flat_parameters, make_optimizer, mlp_batch
from minidist.trace import trace
from minidist.zero import ZeroDataParallel

# "local" is the control: every rank trains alone on its slice, with no communication.
VARIANTS = ("local", "naive_ddp", "bucketed_ddp", "parameter_server", "zero1", "zero2", "zero3")
ZERO_STAGE = {"bucketed_ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def ring_wire_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a traced op of ``payload`` bytes (ring algorithms)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload
    if op == "reduce_scatter_tensor":
        return (n - 1) / n * payload      # payload = full input; each rank sends N−1 chunks
    if op == "all_gather_into_tensor":
        return (n - 1) * payload          # payload = own shard, forwarded N−1 times
    if op in ("send", "isend"):
        return payload
    if op in ("recv", "irecv", "barrier"):
        return 0
    raise ValueError(f"no wire model for {op!r}")


class _Driver:
    """The same four calls (forward, no_sync, step, zero_grad) for every variant."""

    def __init__(self, variant, model, group, lr, optimizer, bucket_cap_bytes, prefetch):
        self.variant, self.model = variant, model
        opt_cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
        opt_kw = {"lr": lr} | ({"momentum": 0.9} if optimizer == "sgd" else {})
        self.optimizer = None
        if variant == "local":
            self.wrapper = model
        elif variant == "naive_ddp":
            self.wrapper = NaiveDDP(model, group)
        elif variant == "bucketed_ddp":
            self.wrapper = BucketedDDP(model, group, bucket_cap_bytes=bucket_cap_bytes)
        elif variant == "parameter_server":
            self.wrapper = ParameterServer(model, lambda ps: make_optimizer(ps, optimizer, lr), group)
            self.optimizer = self.wrapper.optimizer
        elif variant in ("zero1", "zero2"):
            self.wrapper = ZeroDataParallel(model, int(variant[-1]), opt_cls, group, bucket_cap_bytes, **opt_kw)
        elif variant == "zero3":
            self.wrapper = FullyShardedDataParallel(model, optimizer_cls=opt_cls, group=group,
                                                    prefetch=prefetch, **opt_kw)
        else:
            raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
        if variant in ("local", "naive_ddp", "bucketed_ddp"):
            self.optimizer = make_optimizer(model.parameters(), optimizer, lr)
        elif self.optimizer is None:
            self.optimizer = self.wrapper.optimizer

    def __call__(self, x):
        return self.wrapper(x)

    def no_sync(self):
        return self.wrapper.no_sync() if hasattr(self.wrapper, "no_sync") else contextlib.nullcontext()

    def step(self):
        if self.variant == "naive_ddp":
            self.wrapper.sync_gradients()
        if self.variant in ("local", "naive_ddp", "bucketed_ddp"):
            self.optimizer.step()
        else:
            self.wrapper.step()

    def zero_grad(self):
        (self.optimizer if self.variant in ("local", "naive_ddp", "bucketed_ddp") else self.wrapper).zero_grad()

    def state_tensors(self):
        return self.wrapper.state_tensors() if hasattr(self.wrapper, "state_tensors") else list(self.model.parameters())

    def full_parameters(self) -> torch.Tensor:
        ctx = self.wrapper.summon_full_params() if self.variant == "zero3" else contextlib.nullcontext()
        with ctx:
            return flat_parameters(self.model)


def train_on_rank(variant: str, model_kwargs: dict | None = None, steps: int = 3, batch: int = 24,
                  accum: int = 1, use_no_sync: bool = True, lr: float = 1e-2, optimizer: str = "adam",
                  group=None, bucket_cap_bytes: int = 1024, prefetch: bool = False,
                  measure: bool = False) -> dict:
    """Train a :class:`TinyMLP` on this rank; trace (and optionally measure) the last step.

    Returns ``params`` (flat, gathered), ``numel`` (trainable Ψ), ``traced`` ({op: payload
    bytes} of the last step), ``wire_bytes`` (ring-model bytes sent, last step), and with
    ``measure`` ``memory`` (model-state bytes after the last step) and ``peak_step_bytes``.
    """
    rank, n = group_rank_size(group)
    if batch % (n * accum):
        raise ValueError(f"batch={batch} must split evenly into {n} ranks × {accum} micro-batches")
    model = TinyMLP(**(model_kwargs or {}))
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    drv = _Driver(variant, model, group, lr, optimizer, bucket_cap_bytes, prefetch)
    local, micro = batch // n, batch // (n * accum)

    def one_step(step):
        x, y = mlp_batch(step, batch, model.inp.in_features, model.out.out_features)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for m in range(accum):
            quiet = use_no_sync and m < accum - 1
            with drv.no_sync() if quiet else contextlib.nullcontext():
                xm, ym = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
                (F.mse_loss(drv(xm), ym) / accum).backward()   # mean of micro-means = local mean
        drv.step()

    out = {"numel": numel}
    for step in range(steps - 1):
        one_step(step)
        drv.zero_grad()
    with trace() as t:
        if measure:
            # Peak = what was live at the start + the profiler's peak above it. What was live
            # at the start is read at the end (the states after the step, minus what the step
            # allocated and kept): persistent buffers such as DDP's buckets, which hold no
            # gradient between steps, are then counted too.
            _, peak, kept = peak_bytes(one_step, steps - 1)
            out["memory"] = model_state_bytes(drv.state_tensors(), drv.optimizer)
            out["peak_step_bytes"] = out["memory"]["total"] - kept + peak
        else:
            one_step(steps - 1)
    out["traced"] = {}
    for e in t.comm():
        out["traced"][e.op] = out["traced"].get(e.op, 0) + e.nbytes
    out["wire_bytes"] = sum(ring_wire_bytes(op, b, n) for op, b in out["traced"].items())
    drv.zero_grad()
    out["params"] = drv.full_parameters()
    return out


def reference_parameters(model_kwargs: dict | None = None, steps: int = 3, batch: int = 24,
                         lr: float = 1e-2, optimizer: str = "adam") -> torch.Tensor:
    from minidist.models import train_reference
    return flat_parameters(train_reference(TinyMLP(**(model_kwargs or {})), steps, batch, lr, optimizer))


def run_cases(cases: list[dict], group=None) -> list[dict]:
    """Many ``train_on_rank`` cases in one launch (launching costs more than a tiny model)."""
    return [train_on_rank(group=group, **case) for case in cases]


# ----------------------------------------------------------------------------- tour
TOUR_LABELS = {"naive_ddp": "DDP, naive (all-reduce per gradient)",
               "bucketed_ddp": "DDP, bucketed with overlap",
               "parameter_server": "data parallel, parameter server",
               "zero1": "ZeRO-1 (sharded Adam states)",
               "zero2": "ZeRO-2 (+ sharded gradients)",
               "zero3": "ZeRO-3 / FSDP (+ sharded parameters)"}


def theory_wire_bytes(variant: str, numel: int, n: int) -> float:
    """Bytes the busiest rank sends per step, from the lecture: 2(N−1)/N·Ψ for DDP and
    ZeRO-1/2, 3(N−1)/N·Ψ for ZeRO-3, (N−1)·Ψ for the parameter server (fp32 elements)."""
    psi = 4 * numel
    if variant == "parameter_server":
        return (n - 1) * psi
    return (3 if variant == "zero3" else 2) * (n - 1) / n * psi


def tour_row(variant: str, world_size: int = 4) -> dict:
    """One ``minidist tour`` row: error vs reference, traffic vs theory, memory vs formula."""
    import time
    import minidist
    from minidist.cost import zero_memory_bytes_fp32
    case = dict(variant=variant, model_kwargs={"hidden": 32, "tied": True}, batch=24, steps=3,
                bucket_cap_bytes=2048, measure=True)
    start = time.perf_counter()
    out = minidist.launch(run_cases, world_size, [case], timeout=120)
    elapsed = time.perf_counter() - start
    ref = reference_parameters(case["model_kwargs"], case["steps"], case["batch"])
    err = max((o[0]["params"] - ref).abs().max().item() for o in out)
    r0 = out[0][0]
    formula = zero_memory_bytes_fp32(ZERO_STAGE.get(variant, 0), r0["numel"], world_size)["total"]
    mem = r0["memory"]["total"]
    return {"technique": TOUR_LABELS[variant], "world_size": world_size, "max_err": err,
            "bytes_per_rank": max(o[0]["wire_bytes"] for o in out),
            "bytes_theory": theory_wire_bytes(variant, r0["numel"], world_size), "time_s": elapsed,
            "note": (f"ring model of traced payloads; rank-0 model states {mem} B vs formula "
                     f"{formula:.0f} B ({100 * (mem / formula - 1):+.1f}%)"),
            "memory_bytes": mem, "memory_formula": formula, "peak_step_bytes": r0["peak_step_bytes"]}
