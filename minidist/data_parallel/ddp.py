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
* :class:`~minidist.data_parallel.parameter_server.ParameterServer` (its own module) — workers
  push gradients to one server, which sums, updates and sends the parameters back.

Traffic, per rank per step, for Ψ trainable elements: a ring all-reduce moves
2(N−1)/N·Ψ elements. The tracer records a collective's *payload* (its input, Ψ here), so
:func:`minidist.cost.ring_wire_bytes` turns traced payloads into wire bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.data_parallel.common import (GradSyncWrapper, at_end_of_backward, broadcast_module, make_buckets,
                                           trainable_parameters)


# ----------------------------------------------------------------------------- naive
class NaiveDDP(nn.Module):
    """Replicate, and after backward all-reduce every gradient, one tensor at a time.

    Call :meth:`sync_gradients` after ``loss.backward()`` and before ``optimizer.step()``.
    For gradient accumulation, call it only after the last micro-step's backward.
    """

    def __init__(self, module: nn.Module, group=None, broadcast_from: int | None = 0):
        super().__init__()
        self.module, self.group = module, group
        self.rank, self.world_size = group_info(group)
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

    ``overlap=False`` is the plain version to measure the overlap against: the same buckets,
    all launched only when backward has finished, so every all-reduce is exposed.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_bytes: int = 1 << 20,
                 broadcast_from: int | None = 0, overlap: bool = True):
        super().__init__()
        self.module, self.group, self.overlap = module, group, overlap
        self.rank, self.world_size = group_info(group)
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
        if self.overlap:
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
