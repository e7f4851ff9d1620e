"""The one data-parallel training loop: library variants and students' code alike.

Used by the tests, the lab checks, ``minidist tour``, the slides and the benchmarks, so
that all of them compare the same thing: N ranks, each on its contiguous 1/N slice of the
global batch (optionally split into micro-batches), versus
:func:`minidist.models.train_reference` on the whole batch.

What is trained is a :class:`Trainer`: the five calls every data-parallel scheme answers
(forward, the work after backward, step, zero_grad, and the full parameters at the end).
:func:`library_trainer` makes one for each of minidist's own variants; the lab checks wrap
a student's function or class in one. Traffic is the tracer's payload bytes of the last
step, turned into wire bytes by :func:`minidist.cost.ring_wire_bytes`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist.collectives.p2p import group_info
from minidist.cost.data_parallel import ring_wire_bytes
from minidist.data_parallel import (BucketedDDP, FullyShardedDataParallel, NaiveDDP, ParameterServer,
                                    ZeroDataParallel)
from minidist.memory import LiveBytes, model_state_bytes, peak_bytes
from minidist.models import TinyMLP, flat_parameters, local_slice, make_optimizer, mlp_batch, train_reference
from minidist.runtime import device, import_optimizers_before_fork, launch, timed
from minidist.trace import trace

import_optimizers_before_fork()      # the ranks it launches build optimizers: they inherit the import

# "local" is the control: every rank trains alone on its slice, with no communication.
VARIANTS = ("local", "naive_ddp", "bucketed_ddp", "parameter_server", "zero1", "zero2", "zero3")
ZERO_STAGE = {"bucketed_ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


@dataclass
class Trainer:
    """How the loop drives one data-parallel scheme around ``model``."""
    forward: Callable                                    # x -> output
    step: Callable[[], None]                             # the optimizer step (and what it implies)
    zero_grad: Callable[[], None]
    optimizer: torch.optim.Optimizer | None              # for memory accounting
    after_backward: Callable[[], None] = lambda: None    # e.g. an explicit gradient sync
    no_sync: Callable = contextlib.nullcontext           # gradient accumulation without sync
    state_tensors: Callable[[], list] | None = None      # every parameter-like tensor held
    full_parameters: Callable[[], torch.Tensor] | None = None
    extra: dict = field(default_factory=dict)            # reported as is (e.g. bucket count)


def library_trainer(variant: str, optimizer: str = "adam", lr: float = 1e-2, bucket_cap_bytes: int = 1024,
                    prefetch: bool = False) -> Callable[[nn.Module, object], Trainer]:
    """A factory ``(model, group) -> Trainer`` for one of minidist's own ``VARIANTS``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    opt_cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    opt_kw = {"lr": lr} | ({"momentum": 0.9} if optimizer == "sgd" else {})

    def make(model: nn.Module, group) -> Trainer:
        if variant in ("local", "naive_ddp", "bucketed_ddp"):
            wrapper = {"local": lambda: model, "naive_ddp": lambda: NaiveDDP(model, group),
                       "bucketed_ddp": lambda: BucketedDDP(model, group, bucket_cap_bytes=bucket_cap_bytes)}[variant]()
            opt = make_optimizer(model.parameters(), optimizer, lr)
            return Trainer(wrapper, opt.step, opt.zero_grad, opt,
                           after_backward=wrapper.sync_gradients if variant == "naive_ddp" else (lambda: None),
                           no_sync=getattr(wrapper, "no_sync", contextlib.nullcontext))
        if variant == "parameter_server":
            ps = ParameterServer(model, lambda params: make_optimizer(params, optimizer, lr), group)
            return Trainer(ps, ps.step, ps.zero_grad, ps.optimizer)
        if variant in ("zero1", "zero2"):
            wrapper = ZeroDataParallel(model, int(variant[-1]), opt_cls, group, bucket_cap_bytes, **opt_kw)
        else:
            wrapper = FullyShardedDataParallel(model, optimizer_cls=opt_cls, group=group, prefetch=prefetch, **opt_kw)

        def full_parameters():
            ctx = wrapper.summon_full_params() if variant == "zero3" else contextlib.nullcontext()
            with ctx:
                return flat_parameters(model)
        return Trainer(wrapper, wrapper.step, wrapper.zero_grad, wrapper.optimizer, no_sync=wrapper.no_sync,
                       state_tensors=wrapper.state_tensors, full_parameters=full_parameters)
    return make


def train(make_trainer: Callable[[nn.Module, object], Trainer], model_kwargs: dict | None = None,
          steps: int = 3, batch: int = 24, accum: int = 1, use_no_sync: bool = True, group=None,
          measure: bool = False, peak: bool = False, live: bool = False) -> dict:
    """Train a :class:`~minidist.models.TinyMLP` on this rank's device (``minidist.device()``);
    trace the last step.

    Returns ``params`` (flat, full), ``numel`` (trainable Ψ), ``events`` ([(op, payload
    bytes)] of the last step), ``traced`` ({op: payload bytes}), ``wire_bytes`` (ring-model
    bytes sent in the last step) and the trainer's ``extra``. With ``measure``: ``memory``
    (model-state bytes after the last step), ``memory_after_forward`` (between the last
    forward and its backward) and ``memory_after_backward`` (right after the last backward,
    before the step); with ``peak`` also ``peak_step_bytes`` (the absolute
    peak of live memory during the last step, from the profiler's allocation timeline); with
    ``live`` also ``live_bytes``: every byte of tensors on its device the rank held throughout the last
    step (forward, backward, the work after it and the optimizer step), counted from before the
    model was built (:class:`minidist.memory.LiveBytes`): what it keeps from one step to the next.
    """
    rank, n = group_info(group)
    if batch % (n * accum):
        raise ValueError(f"batch={batch} must split evenly into {n} ranks × {accum} micro-batches")
    if peak and live:
        raise ValueError("peak and live each run the profiler: ask for one of them")
    dev = device()
    meter = LiveBytes(dev) if live else None
    with meter.recording() if meter else contextlib.nullcontext():
        model = TinyMLP(**({"device": dev} | (model_kwargs or {})))
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tr = make_trainer(model, group)
        state = tr.state_tensors or (lambda: list(model.parameters()))
        micro = batch // (n * accum)
        out: dict = {"numel": numel}

        def one_step(step, last=False):
            x, y = mlp_batch(step, batch, model.inp.in_features, model.out.out_features, device=dev)
            x, y = local_slice(x, rank, n), local_slice(y, rank, n)
            for m in range(accum):
                quiet = use_no_sync and m < accum - 1
                with tr.no_sync() if quiet else contextlib.nullcontext():
                    xm, ym = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
                    loss = F.mse_loss(tr.forward(xm), ym) / accum          # mean of micro-means = local mean
                    if last and measure and m == accum - 1:    # between forward and backward (ZeRO-3: shards only)
                        out["memory_after_forward"] = model_state_bytes(state(), tr.optimizer)
                    loss.backward()
            if last and (measure or peak):        # hooks that shard gradients must have done so by now
                out["memory_after_backward"] = model_state_bytes(state(), tr.optimizer)
            tr.after_backward()
            tr.step()

        for step in range(steps - 1):
            one_step(step)
            tr.zero_grad()
        with trace() as t:
            if peak:
                # Peak = what was live at the start + the profiler's peak above it. What was live
                # at the start is read at the end (the states after the step, minus what the step
                # allocated and kept): persistent buffers such as DDP's buckets, which hold no
                # gradient between steps, are then counted too.
                _, top, kept = peak_bytes(one_step, steps - 1, True, device=dev)
                out["memory"] = model_state_bytes(state(), tr.optimizer)
                out["peak_step_bytes"] = out["memory"]["total"] - kept + top
            else:
                with meter.phase("step") if meter else contextlib.nullcontext():
                    one_step(steps - 1, True)
                if measure:
                    out["memory"] = model_state_bytes(state(), tr.optimizer)
    if meter:
        out["live_bytes"] = meter.held["step"]
    out["events"] = [(e.op, e.nbytes) for e in t.comm()]
    out["traced"] = {}
    for op, nbytes in out["events"]:
        out["traced"][op] = out["traced"].get(op, 0) + nbytes
    out["wire_bytes"] = sum(ring_wire_bytes(op, b, n) for op, b in out["traced"].items())
    tr.zero_grad()
    out["params"] = tr.full_parameters() if tr.full_parameters else flat_parameters(model)
    return out | tr.extra


def train_variant(variant: str, optimizer: str = "adam", lr: float = 1e-2, bucket_cap_bytes: int = 1024,
                  prefetch: bool = False, **train_kwargs) -> dict:
    """:func:`train` with one of minidist's own variants."""
    return train(library_trainer(variant, optimizer, lr, bucket_cap_bytes, prefetch), **train_kwargs)


def train_cases(cases: list[dict], group=None) -> list[dict]:
    """Many :func:`train_variant` cases in one launch (launching costs more than a tiny model)."""
    return [train_variant(group=group, **case) for case in cases]


def reference_parameters(model_kwargs: dict | None = None, steps: int = 3, batch: int = 24,
                         lr: float = 1e-2, optimizer: str = "adam") -> torch.Tensor:
    """The flat parameters single-process training on the whole batch ends with."""
    return flat_parameters(train_reference(TinyMLP(**(model_kwargs or {})), steps, batch, lr, optimizer))


# ----------------------------------------------------------------------------- step time
def _step_time_body(BucketedDDP, caps, model_kwargs, steps, batch):
    rank, n = group_info()
    rows = []
    for cap in caps:
        model = TinyMLP(**model_kwargs)
        ddp = BucketedDDP(model, bucket_cap_bytes=cap)
        opt = make_optimizer(model.parameters(), "sgd", 1e-3)
        x, y = mlp_batch(0, batch, model.inp.in_features, model.out.out_features)
        x, y = local_slice(x, rank, n), local_slice(y, rank, n)
        times = []
        for step in range(steps + 1):
            dist.barrier()
            with timed() as t:
                F.mse_loss(ddp(x), y).backward()
                ddp.finish_gradient_sync()
                opt.step()
                opt.zero_grad()
            times.append(t.seconds)
        rows.append({"cap": cap, "buckets": len(ddp.buckets), "times": times[1:]})
    return rows


def step_time_vs_bucket_size(BucketedDDP, caps, world_size: int = 2, model_kwargs=None, steps: int = 5,
                             batch: int = 64, timeout: float = 60.0) -> list[dict]:
    """Median step time (slowest rank) of ``BucketedDDP`` for each bucket cap:
    rows of {cap, buckets, step_ms}."""
    model_kwargs = model_kwargs or {"hidden": 256, "n_hidden": 6}
    out = launch(_step_time_body, world_size, BucketedDDP, list(caps), model_kwargs, steps, batch, timeout=timeout)
    rows = []
    for i, cap in enumerate(caps):
        per_step = [max(o[i]["times"][s] for o in out) for s in range(steps)]
        rows.append({"cap": cap, "buckets": out[0][i]["buckets"],
                     "step_ms": 1e3 * sorted(per_step)[len(per_step) // 2]})
    return rows
