"""The bytes autograd keeps for backward (saved-tensor hooks), per forward call, exactly.

What the activation-memory formulas of pipeline and tensor parallelism predict (Korthikanti
et al. 2022, ``sbh(34 + 5as/h)`` per layer without recomputation; :mod:`minidist.cost`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from minidist.memory.states import _storage_key


def _span(t: torch.Tensor):
    """(storage key, first byte, one past the last byte) of the memory ``t`` can read.

    A view's span, not its storage's: a micro-batch sliced out of a batch holds its own
    rows, and Q, K and V viewed out of one projection output cover it once between them."""
    es = t.element_size()
    start = t.storage_offset() * es
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))     # element offset of the far corner
    return _storage_key(t), start, start + (last + 1) * es


def _union(spans) -> int:
    total, reach = 0, -1
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


class ActivationMeter:
    """The one exact count of the bytes autograd keeps for backward (saved-tensor hooks).

    A saved tensor counts the bytes it spans in its storage; tensors that overlap in one
    storage (views of one buffer) count their union once; storages of ``exclude`` (model
    state: parameters, buffers such as a causal mask) never count. Every dtype counts (a
    bool dropout mask is 1 byte per element). A tensor counts from the forward that saves
    it until autograd releases it (the backward that consumes it has run, or the graph was
    dropped), so ``bytes`` is what is held now and ``peak_bytes`` the most held at once.
    Forward calls are numbered (:meth:`recording`, :class:`Metered`) so that
    ``peak_calls`` says how many of them held activations at once (micro-batches, in a
    pipeline). Checked against the formulas of :mod:`minidist.cost` (pipeline, tensor
    parallelism) to the byte.
    """

    def __init__(self, exclude=()):
        self.skip = {_storage_key(q) for q in exclude}
        self.spans: dict[tuple, dict[tuple, int]] = {}    # storage -> (start, end) -> holders alive
        self.covered: dict[tuple, int] = {}               # storage -> bytes of the union of its spans
        self.calls: dict[int, int] = {}                   # forward call -> holders alive
        self.bytes = self.peak_bytes = 0
        self.peak_calls = 0
        self.call = 0

    @contextmanager
    def recording(self):
        """Count what autograd saves inside the block, as one more forward call."""
        self.call += 1
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self

    def pack(self, t):
        if t.numel() == 0:
            return t
        key, start, end = _span(t)
        if key in self.skip or key[3] == 0:
            return t
        return _Held(self, t.detach(), key, (start, end), self.call)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def _change(self, key, span, by: int):
        spans = self.spans.setdefault(key, {})
        spans[span] = spans.get(span, 0) + by
        if spans[span] == 0:
            del spans[span]
        covered = _union(spans)
        self.bytes += covered - self.covered.get(key, 0)
        self.covered[key] = covered
        if not spans:
            del self.spans[key], self.covered[key]

    def _add(self, key, span, call):
        self._change(key, span, 1)
        self.calls[call] = self.calls.get(call, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_calls = max(self.peak_calls, len(self.calls))

    def _drop(self, key, span, call):
        self._change(key, span, -1)
        self.calls[call] -= 1
        if self.calls[call] == 0:
            del self.calls[call]


class _Held:
    """What autograd stores instead of a saved tensor: the tensor, detached (holding an
    output with its grad_fn would make a reference cycle that outlives a dropped graph),
    so its memory cannot be reused while counted, and where it was counted; dropping it
    uncounts."""
    __slots__ = ("meter", "t", "key", "span", "call")

    def __init__(self, meter, t, key, span, call):
        self.meter, self.t, self.key, self.span, self.call = meter, t, key, span, call
        meter._add(key, span, call)

    def __del__(self):
        self.meter._drop(self.key, self.span, self.call)


def model_state(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers: what an :class:`ActivationMeter` leaves out."""
    return [*module.parameters(), *module.buffers()]


def saved_activation_bytes(fn, *args, exclude: nn.Module | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` (a forward); return (its result, bytes autograd holds for
    its backward once it returns), counted by :class:`ActivationMeter` with ``exclude``'s
    parameters and buffers left out."""
    meter = ActivationMeter(model_state(exclude) if exclude is not None else ())
    with meter.recording():
        result = fn(*args, **kwargs)
    return result, meter.bytes


class Metered(nn.Module):
    """A stage whose saved activations are counted by an :class:`ActivationMeter`."""

    def __init__(self, inner: nn.Module, meter: ActivationMeter):
        super().__init__()
        self.inner, self.meter = inner, meter

    def forward(self, x):
        with self.meter.recording():
            return self.inner(x)
