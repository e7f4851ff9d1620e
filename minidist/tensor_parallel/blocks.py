"""Megatron's MLP and self-attention blocks, and the dropout RNG they need.

Shoeybi et al. 2019, "Megatron-LM", Sec. 3 and Fig. 3.

**MLP** Y = GeLU(X Aᵀ) Bᵀ. Split A by rows (column-parallel) and B by columns
(row-parallel): GeLU is elementwise, so rank r computes GeLU(X A_rᵀ) on its own slice of
the hidden features with no communication, and the row-parallel layer's partial sums
meet in one all-reduce. Per MLP: f at the input, g at the output = one all-reduce
forward, one backward. (Splitting A by columns instead would need a sum *before* GeLU,
which is not linear: a second synchronisation.)

**Attention** is independent per head, so split by heads: rank r owns heads
[r·a/t, (r+1)·a/t), i.e. *whole* heads' rows of W_Q, W_K, W_V (one fused column-parallel
matmul), runs softmax attention on them locally, and the output projection W_O is
row-parallel over the same heads. Again one all-reduce forward, one backward. A split
that cuts a head in half would make each rank's qkᵀ a partial dot product: wrong.

**GQA/MQA** (n_kv < a key/value heads, query head i reads kv head i // (a/n_kv)):
if t divides n_kv, rank r takes kv heads [r·n_kv/t, ...), exactly the ones its query
heads read. If n_kv divides t, each kv head is *replicated* on the t/n_kv ranks whose
query heads read it; each of those ranks sees only part of the head's gradient, so the
replicas' gradients are summed during backward (one all-reduce of a buffer with a slot
per kv head) and every replica equals the single-process gradient. Otherwise: error.

**Dropout RNG** (Megatron's ``get_cuda_rng_tracker``, Sec. 3 end): where ranks hold
different data (attention heads; sequence shards under SP) masks must differ per rank,
or all ranks drop the same pattern and the result is not the single-process
distribution; where the tensor is replicated (the residual stream without SP) masks must
be identical, or the replicas drift apart. :class:`RNGTracker` keeps one
``torch.Generator`` per region: "replicated" seeded alike on every rank, "parallel"
seeded with seed + 2718 + tp_rank. Masks are bool (1 byte per element, as Megatron's
fused kernel and as counted by Korthikanti et al.).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.models import causal_attention
from minidist.runtime.device import device as current_device
from minidist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["RNGTracker", "ParallelDropout", "ParallelMLP", "ParallelAttention", "kv_layout"]


# ----------------------------------------------------------------------------- dropout RNG
class RNGTracker:
    """Dropout random streams per region; share one tracker across a whole model.

    One ``torch.Generator`` per (region, device), made on the device of the tensor it
    drops from: on a GPU rank that is a CUDA generator (the state Megatron's tracker
    swaps into ``torch.cuda``), on a CPU rank a CPU one; the global streams stay untouched."""
    REGIONS = ("replicated", "parallel")

    def __init__(self, seed: int = 0, group=None):
        self.seed, (self.rank, _) = seed, group_info(group)
        self._generators: dict = {}

    def generator(self, region: str, device) -> torch.Generator:
        if region not in self.REGIONS:
            raise ValueError(f"unknown RNG region {region!r}: use one of {self.REGIONS}")
        device = torch.device(device)
        key = (region, device)
        if key not in self._generators:
            seed = self.seed if region == "replicated" else self.seed + 2718 + self.rank
            self._generators[key] = torch.Generator(device).manual_seed(seed)
        return self._generators[key]

    def dropout(self, x: torch.Tensor, p: float, region: str, training: bool = True) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        keep = torch.rand(x.shape, generator=self.generator(region, x.device), device=x.device) >= p
        return x * keep * (1.0 / (1.0 - p))     # autograd keeps only the bool mask


class ParallelDropout(nn.Module):
    def __init__(self, p: float, tracker: RNGTracker, region: str):
        super().__init__()
        if region not in RNGTracker.REGIONS:
            raise ValueError(f"unknown RNG region {region!r}: use one of {RNGTracker.REGIONS}")
        self.p, self.tracker, self.region = p, tracker, region

    def forward(self, x):
        return self.tracker.dropout(x, self.p, self.region, self.training)

    def extra_repr(self):
        return f"p={self.p}, region={self.region}"


# ----------------------------------------------------------------------------- MLP
class ParallelMLP(nn.Module):
    """fc (column-parallel) -> GeLU -> proj (row-parallel) -> dropout."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, *, group=None, sequence_parallel: bool = False,
                 dropout: float = 0.0, rng: RNGTracker | None = None, device=None, dtype=None):
        super().__init__()
        rng = rng or RNGTracker(group=group)
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.fc = ColumnParallelLinear(d_model, d_ff, bias, **kw)
        self.act = nn.GELU()
        self.proj = RowParallelLinear(d_ff, d_model, bias, **kw)
        # Without SP the output is replicated; with SP it is this rank's own tokens.
        self.drop = ParallelDropout(dropout, rng, "parallel" if sequence_parallel else "replicated")

    def forward(self, x):
        return self.drop(self.proj(self.act(self.fc(x))))

    @classmethod
    def from_full(cls, mlp: nn.Module, group=None, *, sequence_parallel=False, rng=None):
        """From a module with ``fc``, ``proj`` (nn.Linear) and ``drop`` (minidist.models.GPTMLP)."""
        w = mlp.fc.weight
        out = cls(mlp.fc.in_features, mlp.fc.out_features, mlp.fc.bias is not None, group=group,
                  sequence_parallel=sequence_parallel, dropout=mlp.drop.p, rng=rng, device=w.device, dtype=w.dtype)
        out.fc = ColumnParallelLinear.from_full(mlp.fc, group, sequence_parallel=sequence_parallel)
        out.proj = RowParallelLinear.from_full(mlp.proj, group, sequence_parallel=sequence_parallel)
        return out


# ----------------------------------------------------------------------------- attention
def kv_layout(n_heads: int, n_kv_heads: int, t: int, rank: int) -> tuple[int, int, bool]:
    """(first kv head, kv heads on this rank, replicated?) for query heads split over t ranks."""
    if n_heads % t:
        raise ValueError(f"n_heads = {n_heads} is not divisible by t = {t}: attention is split by whole heads")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads = {n_heads} is not a multiple of n_kv_heads = {n_kv_heads}")
    if n_kv_heads % t == 0:
        return rank * (n_kv_heads // t), n_kv_heads // t, False
    if t % n_kv_heads == 0:
        return rank // (t // n_kv_heads), 1, True
    raise ValueError(f"n_kv_heads = {n_kv_heads} and t = {t}: the key/value heads can be split over t ranks "
                     f"only if t divides n_kv_heads, or replicated only if n_kv_heads divides t")


def _sum_kv_replicas(grad, *, q_rows, slot, n_slots, group):
    """Gradient hook: sum the kv rows over the ranks holding a replica of kv head ``slot``."""
    buf = grad.new_zeros((n_slots, *grad[q_rows:].shape))
    buf[slot] = grad[q_rows:]
    dist.all_reduce(buf, group=group)     # slot i receives the sum of head i's replicas
    return torch.cat([grad[:q_rows], buf[slot]])


class ParallelAttention(nn.Module):
    """Causal self-attention split by heads: fused QKV (column) -> attention -> o (row)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = True, *,
                 seq_len: int, group=None, sequence_parallel: bool = False, dropout: float = 0.0,
                 rng: RNGTracker | None = None, device=None, dtype=None):
        super().__init__()
        rank, t = group_info(group)
        n_kv_heads = n_kv_heads or n_heads
        if d_model % n_heads:
            raise ValueError(f"d_model = {d_model} is not divisible by n_heads = {n_heads}")
        self.kv_first, self.kv_local, self.kv_replicated = kv_layout(n_heads, n_kv_heads, t, rank)
        self.head_dim, self.n_heads, self.n_kv_heads = d_model // n_heads, n_heads, n_kv_heads
        self.q_local, self.group = n_heads // t, group
        rng = rng or RNGTracker(group=group)
        local_rows = (self.q_local + 2 * self.kv_local) * self.head_dim
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(d_model, t * local_rows, bias, **kw)
        self.o = RowParallelLinear(n_heads * self.head_dim, d_model, bias, **kw)
        self.attn_drop = ParallelDropout(dropout, rng, "parallel")
        self.resid_drop = ParallelDropout(dropout, rng, "parallel" if sequence_parallel else "replicated")
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool,
                                                  device=device or current_device()).triu(1), persistent=False)
        if self.kv_replicated and t > 1:
            hook = functools.partial(_sum_kv_replicas, q_rows=self.q_local * self.head_dim, slot=self.kv_first,
                                     n_slots=n_kv_heads, group=group)
            for p in (self.qkv.weight, self.qkv.bias):
                if p is not None:
                    p.register_hook(hook)

    def forward(self, x):
        qkv = self.qkv(x)              # (b, s, local heads' q, k, v); s is whole even under SP
        b, s, _ = qkv.shape
        hd = self.head_dim
        q, k, v = qkv.split([self.q_local * hd, self.kv_local * hd, self.kv_local * hd], dim=-1)
        heads = lambda z: z.view(b, s, -1, hd).transpose(1, 2)     # noqa: E731
        y = causal_attention(heads(q), heads(k), heads(v), self.future, self.attn_drop)
        return self.resid_drop(self.o(y.transpose(1, 2).reshape(b, s, -1)))

    @classmethod
    def from_full(cls, attn: nn.Module, group=None, *, sequence_parallel=False, rng=None):
        """From a module with ``q``, ``k``, ``v``, ``o`` (nn.Linear), ``head_dim``, ``future``
        and ``attn_drop`` (minidist.models.CausalSelfAttention): this rank's whole heads."""
        rank, t = group_info(group)
        hd, w = attn.head_dim, attn.q.weight
        out = cls(attn.q.in_features, attn.q.out_features // hd, attn.k.out_features // hd, attn.q.bias is not None,
                  seq_len=attn.future.shape[0], group=group, sequence_parallel=sequence_parallel,
                  dropout=attn.attn_drop.p, rng=rng, device=w.device, dtype=w.dtype)
        q_rows = slice(rank * out.q_local * hd, (rank + 1) * out.q_local * hd)
        kv_rows = slice(out.kv_first * hd, (out.kv_first + out.kv_local) * hd)

        def pick(name):     # my query heads' rows, then my kv heads' rows of K and of V
            q, k, v = (getattr(attn, m).get_parameter(name) for m in "qkv")
            return torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]).detach()

        out.qkv.load_shard(pick("weight"), pick("bias") if attn.q.bias is not None else None)
        out.o = RowParallelLinear.from_full(attn.o, group, sequence_parallel=sequence_parallel)
        return out
