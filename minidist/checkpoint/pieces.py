"""What a rank holds of a global tensor: a box of it (offsets and lengths per dimension).

Every layout of the course cuts a tensor the same two ways, and both are boxes:

* **a slice along a dimension** (tensor parallelism's column and row pieces, a pipeline
  stage's whole layers, a replica): one box, e.g. rows [r·n/t, (r+1)·n/t) of W;
* **a range of the flattened tensor** (ZeRO-1/2/3 and FSDP's padded flat shards): a range
  [a, b) of a row-major tensor is a union of at most 2·ndim − 1 boxes, each contiguous in
  memory (a partial first row, whole middle rows, a partial last row, recursively).

So a checkpoint is a list of boxes per tensor (the metadata), and loading under another
layout is box intersection: the part of saved box S that target box T needs is S ∩ T, read
from S's file at offsets (S ∩ T) − S and written into T at (S ∩ T) − T. This is the chunk
model of torch.distributed.checkpoint (DCP) and of Megatron's distributed checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Piece", "flat_range_boxes", "flat_pieces", "intersect", "box_slices"]


@dataclass
class Piece:
    """``tensor`` (a view into live state: writing it writes the model or the optimizer) is the
    box of global tensor ``key`` (shape ``global_shape``) that starts at ``offsets``. ``loaded``:
    whether the last :func:`~minidist.checkpoint.load.load` filled it (an optional ``rng.`` piece
    the checkpoint lacks is not)."""
    key: str
    tensor: torch.Tensor
    global_shape: tuple
    offsets: tuple
    loaded: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.global_shape, self.offsets = tuple(int(s) for s in self.global_shape), tuple(int(o) for o in self.offsets)
        if len(self.offsets) != len(self.global_shape) or self.tensor.dim() != len(self.global_shape):
            raise ValueError(f"{self.key}: a piece of shape {tuple(self.tensor.shape)} at offsets {self.offsets} "
                             f"does not fit a tensor of shape {self.global_shape}")
        if any(o < 0 or o + n > s for o, n, s in zip(self.offsets, self.tensor.shape, self.global_shape)):
            raise ValueError(f"{self.key}: the box at {self.offsets} of size {tuple(self.tensor.shape)} "
                             f"leaves the tensor's shape {self.global_shape}")

    @property
    def lengths(self) -> tuple:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def flat_range_boxes(shape, start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """[start, stop) of the row-major flattening of ``shape`` as (offsets, lengths) boxes, in order.
    Each box is contiguous, so a flat slice splits into the boxes one after the other."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {math.prod(shape)} elements")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    lead = lambda i, boxes: [((i,) + o, (1,) + n) for o, n in boxes]   # noqa: E731
    if i0 == i1:
        return lead(i0, flat_range_boxes(shape[1:], r0, r1))
    out = []
    if r0:
        out += lead(i0, flat_range_boxes(shape[1:], r0, inner))
        i0 += 1
    if i1 > i0:
        out.append(((i0,) + (0,) * (len(shape) - 1), (i1 - i0,) + shape[1:]))
    if r1:
        out += lead(i1, flat_range_boxes(shape[1:], 0, r1))
    return out


def flat_pieces(key: str, global_shape, flat: torch.Tensor, start: int) -> list[Piece]:
    """The pieces of a flat shard ``flat`` holding elements [start, start + len(flat)) of ``key``."""
    out, at = [], 0
    for offsets, lengths in flat_range_boxes(global_shape, start, start + flat.numel()):
        n = math.prod(lengths)
        out.append(Piece(key, flat[at:at + n].view(lengths), global_shape, offsets))
        at += n
    return out


def intersect(a_off, a_len, b_off, b_len):
    """The box both boxes cover, as (offsets, lengths), or None."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_len, b_off, b_len)]
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi))


def box_slices(offsets, lengths, origin) -> tuple:
    """Index of box (offsets, lengths) inside a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(o - g, o - g + n) for o, n, g in zip(offsets, lengths, origin))
