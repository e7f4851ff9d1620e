"""A data order that survives a restart: the position is part of the checkpoint.

Epoch e visits the N examples in the permutation drawn from ``seed + e`` (the same on every
rank, without communication), in global batches of B; the whole state is (epoch, position),
two integers that go into the checkpoint's ``extra``. A resumed run, on the same number of
ranks or another, continues with exactly the batch the interrupted run would have taken
next: no example seen twice, none skipped. Each data-parallel rank takes its contiguous slice
of the global batch (:func:`minidist.models.local_slice`), so the global batch, and thus the
update, does not depend on the number of ranks.
"""
from __future__ import annotations

import torch

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """``next_batch()`` -> the indices of the next global batch; ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, n: int, batch: int, seed: int = 0, drop_last: bool = True):
        if not (isinstance(n, int) and isinstance(batch, int) and 1 <= batch <= n):
            raise ValueError(f"need integers 1 <= batch <= n, got batch={batch!r}, n={n!r}")
        self.n, self.batch, self.seed, self.drop_last = n, batch, seed, drop_last
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.n, generator=torch.Generator(device="cpu").manual_seed(self.seed + epoch),
                              device="cpu")       # an order of host indices, whatever the default device

    def next_batch(self) -> torch.Tensor:
        left = self.n - self.position
        if left == 0 or (self.drop_last and left < self.batch):
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order(self.epoch)[self.position:self.position + self.batch]
        self.position += len(idx)
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "n": self.n, "batch": self.batch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for k in ("n", "batch", "seed"):
            if state.get(k) != getattr(self, k):
                raise ValueError(f"the checkpoint's sampler has {k}={state.get(k)!r}, this one {getattr(self, k)!r}: "
                                 "a different data order cannot be resumed")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
