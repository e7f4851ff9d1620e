"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Shoeybi et al. 2019, "Megatron-LM", Sec. 3. For Y = X Wᵀ + b with W of shape
(out, in) (``nn.Linear``'s layout) on t ranks:

* **column-parallel**: rank r holds rows r of W (out/t outputs) and of b, and computes
  Y_r = X W_rᵀ + b_r, its slice of the output features. X must be whole on every rank,
  so the layer starts with f (:func:`~minidist.tensor_parallel.comm.copy_to_tp`).
  Optionally all-gather Y at the end (``gather_output``).
* **row-parallel**: rank r holds columns r of W (in/t inputs) and takes X_r, the slice
  of the input features a column-parallel layer left on it. X_r W_rᵀ is a partial sum of
  Y; g (:func:`~minidist.tensor_parallel.comm.reduce_from_tp`) adds them, and the bias
  is added once, *after* that sum (added before, it would be counted t times).
* **vocab-parallel embedding** (Sec. 3, "input embedding"): rank r holds the rows of its
  range of token ids; ids outside the range look up row 0 and are zeroed, so the
  all-reduce of g assembles every token's embedding from the one rank that owns it.

Column then row is the Megatron pair: one all-reduce forward (g) and one backward (f).
With ``sequence_parallel=True`` (Korthikanti et al. 2022) the column layer's input and
the row layer's output are sharded along the sequence (dim 1): the column layer
all-gathers, the row layer reduce-scatters (:mod:`.sequence_parallel`).

Layers are built from full weights with ``from_full(module, group)`` (so tests compare
with one process; the shard lands on the full module's device) or from sizes, then
``load_shard`` (``device=`` defaults to this rank's, ``minidist.device()``). Shards follow
``tensor_split``: rank r owns chunk r; the linear layers need sizes divisible by t, the
embedding does not.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minidist.collectives.p2p import group_info
from minidist.runtime.device import device as current_device
from minidist.tensor_parallel.comm import (copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_along_dim,
                                           shard_range, split_along_dim)
from minidist.tensor_parallel.sequence_parallel import (SEQ_DIM, _check_seq, mark_sequence_parallel,
                                                        sequence_parallel_linear)

__all__ = ["column_parallel_linear", "row_parallel_linear", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding"]


def _divisible(n: int, t: int, what: str) -> None:
    if n % t:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size t = {t}")


def _check_shape(tensor, expected: tuple, what: str) -> None:
    if tensor is not None and tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}; this rank's shard must be {tuple(expected)}")


# ----------------------------------------------------------------------------- functional
def column_parallel_linear(x, weight, bias=None, group=None, *, gather_output: bool = False,
                           sequence_parallel: bool = False):
    """Y_r = X W_rᵀ + b_r with ``weight`` = rows r of W, shape (out/t, in).

    ``x``: (..., in), whole on every rank; with ``sequence_parallel``, (b, s/t, in), this
    rank's sequence shard. Returns (..., out/t), or (..., out) with ``gather_output``."""
    _check_shape(bias, (weight.shape[0],), "bias")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features; the weight shard {tuple(weight.shape)} expects "
                         f"{weight.shape[1]}")
    if sequence_parallel:
        y = sequence_parallel_linear(x, weight, bias, group)
    else:
        y = F.linear(copy_to_tp(x, group), weight, bias)
    return gather_from_tp(y, -1, group) if gather_output else y


def row_parallel_linear(x, weight, bias=None, group=None, *, input_is_parallel: bool = True,
                        sequence_parallel: bool = False):
    """Y = Σ_r X_r W_rᵀ + b with ``weight`` = columns r of W, shape (out, in/t).

    ``x``: (..., in/t), this rank's input features (or the whole (..., in) when
    ``input_is_parallel=False``: it is split here). Returns (..., out) replicated, or this
    rank's (b, s/t, out) sequence shard with ``sequence_parallel``."""
    _, t = group_info(group)
    _check_shape(bias, (weight.shape[0],), "bias")
    expected = weight.shape[1] if input_is_parallel else weight.shape[1] * t
    if x.shape[-1] != expected:
        raise ValueError(f"input has {x.shape[-1]} features; the weight shard {tuple(weight.shape)} expects "
                         f"{expected}" + ("" if input_is_parallel else " (the whole input)"))
    if sequence_parallel:
        _check_seq(x, group)
    if not input_is_parallel:
        x = split_along_dim(x, -1, group)
    partial = F.linear(x, weight)
    y = reduce_scatter_along_dim(partial, SEQ_DIM, group) if sequence_parallel else reduce_from_tp(partial, group)
    return y if bias is None else y + bias


# ----------------------------------------------------------------------------- modules
class _ShardedLinear(nn.Module):
    """Parameters and loading shared by the two linear layers (``shard_dim`` is what is cut)."""
    shard_dim: int

    def __init__(self, in_features, out_features, bias, group, device, dtype):
        super().__init__()
        self.rank, self.t = group_info(group)
        self.group, self.in_features, self.out_features = group, in_features, out_features
        _divisible((out_features, in_features)[self.shard_dim], self.t,
                   ("out_features", "in_features")[self.shard_dim])
        shape = [out_features, in_features]
        shape[self.shard_dim] //= self.t
        device = device or current_device()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        bound = 1 / math.sqrt(in_features)      # nn.Linear's default scale for the full matrix
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def load_shard(self, weight, bias=None):
        """Copy this rank's shard in (shapes checked first: ValueError, no collective)."""
        _check_shape(weight, self.weight.shape, "weight")
        if bias is not None and self.bias is None:
            raise ValueError("this layer was built with bias=False")
        _check_shape(bias, (self.weight.shape[0],), "bias")
        with torch.no_grad():
            self.weight.copy_(weight)
            if bias is not None:
                self.bias.copy_(bias)
        return self

    @classmethod
    def from_full(cls, linear: nn.Linear, group=None, **kwargs):
        """This rank's shard of a full ``nn.Linear`` (same dtype and device)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device=w.device, dtype=w.dtype, **kwargs)
        chunk = lambda p: p.detach().tensor_split(layer.t, dim=layer.shard_dim)[layer.rank]  # noqa: E731
        bias = linear.bias
        if bias is not None:
            bias = chunk(bias).detach() if cls.shard_dim == 0 else bias.detach()
        return layer.load_shard(chunk(w), bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, t={self.t}, "
                f"shard={tuple(self.weight.shape)}, bias={self.bias is not None}")


class ColumnParallelLinear(_ShardedLinear):
    """``nn.Linear`` with its output features (rows of W, and b) split over the group."""
    shard_dim = 0

    def __init__(self, in_features, out_features, bias=True, *, group=None, gather_output=False,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, device, dtype)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel

    def forward(self, x):
        return column_parallel_linear(x, self.weight, self.bias, self.group, gather_output=self.gather_output,
                                      sequence_parallel=self.sequence_parallel)


class RowParallelLinear(_ShardedLinear):
    """``nn.Linear`` with its input features (columns of W) split; b whole, added once."""
    shard_dim = 1

    def __init__(self, in_features, out_features, bias=True, *, group=None, input_is_parallel=True,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, device, dtype)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        if sequence_parallel:       # added to a sequence shard: its gradient is partial
            mark_sequence_parallel(self.bias)

    def forward(self, x):
        return row_parallel_linear(x, self.weight, self.bias, self.group, input_is_parallel=self.input_is_parallel,
                                   sequence_parallel=self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows (token ids) split over the group, unevenly if need be.

    Output (b, s, dim) replicated, or with ``sequence_parallel`` this rank's (b, s/t, dim)."""

    def __init__(self, num_embeddings, embedding_dim, *, group=None, sequence_parallel=False,
                 device=None, dtype=None):
        super().__init__()
        self.rank, self.t = group_info(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if num_embeddings < self.t:
            raise ValueError(f"a vocabulary of {num_embeddings} cannot be split over t = {self.t} ranks")
        self.start, self.stop = shard_range(num_embeddings, self.rank, self.t)
        self.weight = nn.Parameter(torch.randn(self.stop - self.start, embedding_dim, device=device or current_device(),
                                               dtype=dtype))

    def load_shard(self, weight):
        _check_shape(weight, self.weight.shape, "weight")
        with torch.no_grad():
            self.weight.copy_(weight)
        return self

    @classmethod
    def from_full(cls, embedding: nn.Embedding, group=None, **kwargs):
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, device=w.device,
                    dtype=w.dtype, **kwargs)
        return layer.load_shard(w.detach()[layer.start:layer.stop])

    def forward(self, ids):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got [{int(ids.min())}, "
                             f"{int(ids.max())}]")
        if self.sequence_parallel:
            _check_seq(ids, self.group)
        if self.t == 1:
            return F.embedding(ids, self.weight)
        foreign = (ids < self.start) | (ids >= self.stop)       # owned by another rank
        rows = F.embedding((ids - self.start).masked_fill(foreign, 0), self.weight)
        partial = rows.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_along_dim(partial, SEQ_DIM, self.group)
        return reduce_from_tp(partial, self.group)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.start}, {self.stop}), t={self.t}"
