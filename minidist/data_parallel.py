"""Data parallelism: replicate the model, split the batch, average the gradients.

Every rank holds the whole model and runs forward/backward on its slice of the global
batch. With the loss a mean over equal slices, the full-batch gradient is the average of
the ranks' gradients, g = (1/N) Σ_r g_r, so after one all-reduce every rank takes the
same optimizer step as single-process training on the whole batch.

* :class:`NaiveDDP` — after backward, one all-reduce per gradient.
* :class:`BucketedDDP` — gradients packed into ~``bucket_cap_bytes`` buckets in reverse
  layer order; a bucket's all-reduce starts (async) from the gradient hooks the moment its
  last gradient is ready, overlapping the rest of backward (Li et al. 2020, "PyTorch
  Distributed: Experiences on Accelerating Data Parallel Training", VLDB).
* :class:`ParameterServer` — workers push gradients to one server, which sums, updates and
  sends the parameters back (Li et al. 2014, "Scaling Distributed Machine Learning with
  the Parameter Server", OSDI).

Traffic, per rank per step, for Ψ trainable elements: a ring all-reduce moves
2(N−1)/N·Ψ elements. The tracer records a collective's *payload* (its input, Ψ here), so
:func:`minidist.dp_harness.ring_wire_bytes` turns traced payloads into wire bytes.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable


def group_rank_size(group=None) -> tuple[int, int]:
    """(rank, world size) inside ``group``, with a clear error before any collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run this inside minidist.launch(...)")
    return dist.get_rank(group), dist.get_world_size(group)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that need gradient sync: shared (tied) ones once, frozen ones not at all."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no parameter with requires_grad=True: nothing to synchronise")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
    return params


def broadcast_module(module: nn.Module, src: int = 0, group=None) -> None:
    """Make every rank start from rank ``src``'s weights (replicas must be identical)."""
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, group=group, group_src=src)


def at_end_of_backward(callback) -> None:
    """Run ``callback`` when the current backward pass finishes (must be called from a hook).

    This is the autograd engine's own mechanism, the one torch DDP uses to wait for its
    buckets: ``loss.backward()`` then returns with the gradients already synchronised.
    """
    Variable._execution_engine.queue_callback(callback)


# ----------------------------------------------------------------------------- naive
class GradSyncWrapper(nn.Module):
    """What every data-parallel wrapper here shares: it runs the wrapped module, and
    ``no_sync()`` turns its gradient communication off for the backward passes inside
    (gradient accumulation: the last micro-step, outside the block, syncs the sum)."""

    _sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


class NaiveDDP(nn.Module):
    """Replicate, and after backward all-reduce every gradient, one tensor at a time.

    Call :meth:`sync_gradients` after ``loss.backward()`` and before ``optimizer.step()``.
    For gradient accumulation, call it only after the last micro-step's backward.
    """

    def __init__(self, module: nn.Module, group=None, broadcast_from: int | None = 0):
        super().__init__()
        self.module, self.group = module, group
        self.rank, self.world_size = group_rank_size(group)
        self.params = trainable_parameters(module)
        if broadcast_from is not None:
            broadcast_module(module, broadcast_from, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:        # unused this step: still take part, or the others hang
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.world_size)   # sum -> mean: the loss is a mean over the global batch


# ----------------------------------------------------------------------------- bucketed
class _Bucket:
    """Parameters whose gradients live in one flat buffer and are all-reduced together."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.reset()

    def reset(self):
        self.ready: set[int] = set()   # indices of params whose gradient is final
        self.work = None

    def adopt(self, i: int) -> None:
        """Make params[i].grad a view into the buffer, so all-reducing the buffer syncs it."""
        p, view = self.params[i], self.views[i]
        if p.grad is None:
            view.zero_()               # no gradient at all this step counts as zero
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)         # e.g. after zero_grad(set_to_none=True)
        p.grad = view


def make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Greedy buckets of at most ``cap_bytes`` (a bigger single tensor gets its own bucket).

    Reverse registration order approximates the order gradients become ready in backward,
    so the first bucket fills first. A dtype change starts a new bucket (one flat buffer).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {cap_bytes}")
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(GradSyncWrapper):
    """DDP with gradient buckets whose all-reduces overlap backward.

    Each parameter's ``post_accumulate_grad`` hook marks it ready; when a bucket's last
    gradient is ready, its all-reduce is launched with ``async_op=True`` and backward goes
    on. Buckets are launched strictly in order (bucket k only after k−1): gloo matches
    collectives by call order, so every rank must issue them in the same sequence even if
    their hooks fire in a different order. At the end of backward, buckets still waiting
    (a parameter unused in this step never fires its hook) are launched with zeros for the
    missing gradients, and every all-reduce is waited for, so ``loss.backward()`` returns
    with averaged gradients and ``optimizer.step()`` can follow directly.

    Gradients are views into the bucket buffers (like torch's ``gradient_as_bucket_view``),
    so gradient memory is Ψ, not 2Ψ.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_bytes: int = 1 << 20,
                 broadcast_from: int | None = 0):
        super().__init__()
        self.module, self.group = module, group
        self.rank, self.world_size = group_rank_size(group)
        params = trainable_parameters(module)
        self.buckets = [_Bucket(ps) for ps in make_buckets(params, bucket_cap_bytes)]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._sync = True
        self._next = 0                   # first bucket not yet launched
        self._in_backward = False
        if broadcast_from is not None:
            broadcast_module(module, broadcast_from, group)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket, i = self._where[id(p)]
        bucket.adopt(i)
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            at_end_of_backward(self.finish_gradient_sync)
        bucket.ready.add(i)
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                return
            b.buffer.div_(self.world_size)   # average; dividing first keeps the sum in range
            b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
            self._next += 1

    def finish_gradient_sync(self) -> None:
        """Launch the buckets that never filled, then wait for all (end of backward)."""
        if not self._in_backward:
            return
        for b in self.buckets[self._next:]:
            for i in range(len(b.params)):
                if i not in b.ready:
                    b.adopt(i)
                    b.ready.add(i)
        self._launch_ready_buckets()
        for b in self.buckets:
            b.work.wait()
            b.reset()
        self._next, self._in_backward = 0, False


# ----------------------------------------------------------------------------- parameter server
class ParameterServer:
    """Replicate → split data → compute → push & sum → update → pull.

    Rank ``server`` (in ``group``) computes like everyone else, but also receives every
    worker's flat gradient, averages, takes the optimizer step and sends the new flat
    parameters back. Only the server holds optimizer state (``make_optimizer`` is called
    there only). Traffic is point-to-point and lopsided: each worker sends and receives
    Ψ, the server receives and sends (N−1)·Ψ — the bottleneck that all-reduce removes.
    """

    def __init__(self, module: nn.Module, make_optimizer, group=None, server: int = 0,
                 broadcast_from: int | None = 0):
        self.module, self.group, self.server = module, group, server
        self.rank, self.world_size = group_rank_size(group)
        if not 0 <= server < self.world_size:
            raise ValueError(f"server must be a rank in [0, {self.world_size}), got {server}")
        self.params = trainable_parameters(module)
        self.optimizer = make_optimizer(self.params) if self.rank == server else None
        if broadcast_from is not None:
            broadcast_module(module, broadcast_from, group)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])

    def _unflatten_into(self, flat: torch.Tensor, targets) -> None:
        offset = 0
        for p, t in zip(self.params, targets):
            t.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def step(self) -> None:
        """Push gradients, let the server update, pull parameters. Call after backward."""
        flat = self._flat_grads()
        if self.rank != self.server:
            dist.send(flat, group=self.group, group_dst=self.server)
            dist.recv(flat, group=self.group, group_src=self.server)   # reuse: now parameters
            with torch.no_grad():
                self._unflatten_into(flat, self.params)
            return
        others = [r for r in range(self.world_size) if r != self.server]
        inbox = {r: torch.empty_like(flat) for r in others}
        for work in [dist.irecv(inbox[r], group=self.group, group_src=r) for r in others]:
            work.wait()
        for r in others:              # fixed order: the sum is the same whoever arrives first
            flat += inbox[r]
        flat /= self.world_size
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._unflatten_into(flat, [p.grad for p in self.params])
        self.optimizer.step()
        new = torch.cat([p.detach().reshape(-1) for p in self.params])
        for work in [dist.isend(new, group=self.group, group_dst=r) for r in others]:
            work.wait()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def tour_entries():
    """``minidist tour`` rows for the data-parallel variants (run on 4 CPU ranks)."""
    from minidist.dp_harness import tour_row
    from minidist.tour import TourEntry
    return [TourEntry(v, 4, lambda v=v: tour_row(v)) for v in ("naive_ddp", "bucketed_ddp", "parameter_server")]
