"""The bytes of the tensors a piece of code creates and still holds: its temporaries, and their peak.

A ZeRO step promises more than the model states after it: the all-gather that rebuilds the
parameters runs unit by unit into the parameters' own buffer, so the step's temporaries stay
at a shard or a unit (the constant-size buffers of Rajbhandari et al. 2019), never a second
copy of all ``4Ψ`` bytes. :class:`CreatedBytes` measures exactly that: every storage an
operator creates while the mode is on (an output whose storage no input had) counts from its
creation until the last tensor on it is gone, views included. What the operators work on in
place, and what the communication backend allocates inside a collective, never counts, so the
measurement is the same on every run and every backend. :meth:`CreatedBytes.paused` leaves
out a call inside (e.g. the optimizer's step and its own temporaries).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


class CreatedBytes(TorchDispatchMode):
    """``with CreatedBytes() as meter: fn()``; then ``meter.peak`` is the most bytes of storages
    created under the mode that were alive at once, ``meter.bytes`` those alive now."""

    def __init__(self):
        super().__init__()
        self.holders: dict[int, list[int]] = {}      # data pointer -> [bytes, tensors alive on it]
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._hold(t, inputs)
        return out

    def _hold(self, t: torch.Tensor, inputs: set) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.holders:                      # a view of something created here
            self.holders[ptr][1] += 1
        elif storage.nbytes() and ptr not in inputs:
            self.holders[ptr] = [storage.nbytes(), 1]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        else:                                        # made before, or worked on in place
            return
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.holders[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.holders[ptr]

    @staticmethod
    @contextmanager
    def paused():
        """Run the block without the mode: what it creates does not count."""
        with _disable_current_modes():
            yield
