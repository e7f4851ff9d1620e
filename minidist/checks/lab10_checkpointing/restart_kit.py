"""What lab 10's restart exercise (``train_resumable``, section 6) hands out: how a rank builds a fresh
run (:func:`new_run`), the data-parallel step it repeats (:func:`training_step`), the data sampler
whose position is part of the state (:class:`Sampler`) and the store it saves into (:class:`Store`).

A relaunched rank runs the same code as the first launch: :func:`new_run` seeds every generator the
step draws from (torch's, Python's, numpy's) from a seed and the rank, and builds the model (the same
weights on every rank), Adam, a loss scaler and the sampler at their start. What makes the
relaunched run continue where the crashed one was is what ``train_resumable`` restores from the
store. The step draws from all three generators: Python's chooses whether to flip an example's
features, numpy's adds noise to them, torch's draws the model's dropout masks.

The loss scaler is lab 8's (:class:`minidist.memory_techniques.DynamicLossScaler`), started near fp32's
largest number so that it overflows now and then in fp32 too: its state (scale, clean steps) changes
as fp16 training's would. The store is not the format of sections 1-3: every rank writes its own file
with ``torch.save`` (a temporary file, then a rename), and a checkpoint counts once every rank has its
file.
"""
from __future__ import annotations

import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.memory_techniques.loss_scaler import DynamicLossScaler
from minidist.runtime.device import device as rank_device

SEED = 1234                 # + rank: each rank's torch, Python and numpy generators
EXAMPLES, BATCH = 20, 4     # the data set, and the global batch (each of the ranks takes its slice)
DIMS = (6, 16, 3)
LR = 1e-2
#: near fp32's top (2^128): some steps' scaled gradients overflow, the scale backs off and grows again
SCALER = dict(init_scale=2.0 ** 126, growth_interval=2)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed examples (x, y), the same on every rank (host memory)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    return (torch.randn(EXAMPLES, DIMS[0], generator=g, device="cpu"),
            torch.randn(EXAMPLES, DIMS[-1], generator=g, device="cpu"))


class Sampler:
    """This rank's batches: epoch e visits the examples in the order drawn from ``seed + e`` (its own
    generator, not the global ones), a global batch of ``BATCH`` at a time, this rank taking its slice.
    ``next_batch()`` -> (x, y) on :func:`minidist.device`; ``state_dict()`` / ``load_state_dict()``: the
    position, ``{"epoch": e, "position": p}`` (examples of epoch e already taken)."""

    def __init__(self, rank: int, world: int, seed: int = 3):
        if BATCH % world:
            raise ValueError(f"the global batch of {BATCH} does not split over {world} ranks")
        self.rank, self.world, self.seed = rank, world, seed
        self.xs, self.ys = dataset()
        self.epoch, self.position = 0, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + BATCH > EXAMPLES:          # the last incomplete batch is dropped
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(EXAMPLES, generator=torch.Generator(device="cpu").manual_seed(self.seed + self.epoch),
                               device="cpu")
        per = BATCH // self.world
        mine = order[self.position + self.rank * per:self.position + (self.rank + 1) * per]
        self.position += BATCH
        return self.xs[mine].to(rank_device()), self.ys[mine].to(rank_device())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def new_run(rank: int, world: int, scaler: bool = True):
    """(model, optimizer, scaler or None, sampler) as a freshly launched rank has them, every generator of
    the rank seeded from ``SEED + rank``. The model's weights come from a generator of their own: equal
    on every rank, whatever the global generators hold."""
    torch.manual_seed(SEED + rank)
    random.seed(SEED + rank)
    np.random.seed(SEED + rank)
    g, dev = torch.Generator(device="cpu").manual_seed(11), rank_device()
    model = torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1], device=dev), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                torch.nn.Linear(DIMS[1], DIMS[2], device=dev))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer, DynamicLossScaler(**SCALER) if scaler else None, Sampler(rank, world)


def local_gradients(model, scaler, batch) -> float:
    """The first half of :func:`training_step`, one rank's own: the random flip and noise, the forward
    (dropout), the backward of the (scaled) loss. Returns the loss."""
    x, y = batch
    if random.random() < 0.5:                       # Python's generator: flip the features
        x = x.flip(-1)
    noise = np.random.normal(0.0, 0.1, size=tuple(x.shape))         # numpy's generator: input noise
    x = x + torch.as_tensor(noise, dtype=x.dtype, device=x.device)
    loss = F.mse_loss(model(x), y)                  # torch's generator: the dropout mask
    for p in model.parameters():
        p.grad = None
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.item()


def apply_update(model, optimizer, scaler, world: int) -> None:
    """The second half of :func:`training_step`, once the gradients are summed over the ranks: the mean,
    the scaler's unscale and update (a step that overflowed is skipped), the optimizer's step."""
    for p in model.parameters():
        p.grad.div_(world)
    if scaler is not None:
        found_inf = scaler.unscale_(model.parameters())
        scaler.update(found_inf)
        if found_inf:
            return
    optimizer.step()


def training_step(model, optimizer, scaler, batch, group=None) -> float:
    """One data-parallel step on ``batch`` (this rank's (x, y)): local gradients, their sum over
    ``group`` (every rank's sum is the same), the update. ``scaler``: a loss scaler, or None. Returns
    this rank's loss."""
    loss = local_gradients(model, scaler, batch)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
    apply_update(model, optimizer, scaler, world)
    return loss


class Store:
    """Checkpoints of one rank under ``root``: ``root/rank<r>/step_<s>.pt``.

    ``save(step, state)``: ``torch.save`` of ``state`` (anything ``torch.save`` takes: tensors, dicts,
    lists, tuples, numbers, numpy arrays) into a temporary file, then a rename: a crash leaves no half
    file under the final name. ``latest()``: ``(step, state)`` of the largest step that **every** rank
    of the job has saved (a rank that crashed before its rename has not), this rank's state, loaded
    into new objects; None when there is none."""

    def __init__(self, root: str, rank: int, world: int):
        self.root, self.rank, self.world = root, rank, world

    def _path(self, rank: int, step: int) -> str:
        return os.path.join(self.root, f"rank{rank}", f"step_{step}.pt")

    def save(self, step: int, state) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"a checkpoint's step is an int >= 0, got {step!r}")
        path = self._path(self.rank, step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path + ".tmp")
        self.written(step)
        os.replace(path + ".tmp", path)

    def written(self, step: int) -> None:
        """Between the write and the rename (the checks' crash mid-save happens here); nothing by default."""

    def steps(self, rank: int) -> set[int]:
        """The steps ``rank`` has saved."""
        folder = os.path.join(self.root, f"rank{rank}")
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return {int(m.group(1)) for m in map(re.compile(r"step_(\d+)\.pt").fullmatch, names) if m}

    def latest(self):
        common = set.intersection(*(self.steps(r) for r in range(self.world)))
        if not common:
            return None
        step = max(common)
        return step, torch.load(self._path(self.rank, step), weights_only=False, map_location="cpu")
