"""Which boxes of which global tensors a rank holds, for every layout of the course.

A checkpoint names tensors by the single-process model's parameter names (``inp.weight``,
``blocks.3.attn.q.weight``) and optimizer states by ``optim.<name>.<state>`` (Adam's
``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``), plus one ``optim.step``. Each adapter
returns a :class:`State`: the pieces this rank **writes** (the ones it owns: a tensor held by
several ranks is written by one of them only), the pieces it must **fill** when loading (all
that it holds), and what to do after filling them.

* :func:`replicated` — plain model, DDP (one copy per rank; DP rank 0 writes it);
* :func:`flat_sharded` — ZeRO-1/2 (:class:`~minidist.data_parallel.zero.ZeroDataParallel`)
  and ZeRO-3/FSDP (:class:`~minidist.data_parallel.fsdp.FullyShardedDataParallel`): each
  rank's slice [r·S, (r+1)·S) of every padded flat buffer (Rajbhandari et al. 2019);
* :func:`trainer3d` — DP × PP × TP (:class:`~minidist.mesh.Trainer3D`): a stage's layers,
  Megatron's column (rows of W) and row (columns of W) pieces, replicas on TP rank 0;
* :func:`dtensors` — a state dict of DTensors on a device mesh (what torch's DCP saves).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from minidist.checkpoint.pieces import Piece, flat_pieces

__all__ = ["State", "replicated", "flat_sharded", "trainer3d", "dtensors", "ensure_optimizer_state"]

OPTIMIZER_STATES = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}


@dataclass
class State:
    save: list[Piece] = field(default_factory=list)
    load: list[Piece] = field(default_factory=list)
    after_load: list = field(default_factory=list)

    def __add__(self, other: "State") -> "State":
        return State(self.save + other.save, self.load + other.load, self.after_load + other.after_load)

    @property
    def bytes_written(self) -> int:
        return sum(p.nbytes for p in self.save)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Create the states torch creates lazily at the first step (zeros, step 0: the same numbers
    the first step would start from), so a fresh optimizer has tensors to load into."""
    kind = type(optimizer).__name__
    if kind not in OPTIMIZER_STATES:
        raise ValueError(f"checkpointing knows Adam, AdamW and SGD, not {kind}")
    for group in optimizer.param_groups:
        if kind == "SGD" and not group.get("momentum"):
            raise ValueError("SGD without momentum has no state to checkpoint: use momentum > 0 or Adam")
        for p in group["params"]:
            st = optimizer.state[p]
            for name in OPTIMIZER_STATES[kind]:
                if st.get(name) is None:
                    st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if kind != "SGD" and "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")    # where torch's Adam keeps it
    return OPTIMIZER_STATES[kind]


def _step_state(optimizer, owner: bool) -> State:
    """One ``optim.step`` for all parameters (they all step together)."""
    if type(optimizer).__name__ == "SGD":
        return State()
    steps = [optimizer.state[p]["step"] for g in optimizer.param_groups for p in g["params"]]
    scratch = torch.zeros((), dtype=torch.float32, device=steps[0].device if steps else "cpu")

    def spread():
        for s in steps:
            s.copy_(scratch)

    piece = Piece("optim.step", steps[0].reshape(()), (), ())
    return State([piece] if owner else [], [Piece("optim.step", scratch, (), ())], [spread])


def _whole(key, t: torch.Tensor, owner: bool) -> State:
    piece = Piece(key, t.detach(), tuple(t.shape), (0,) * t.dim())
    return State([piece] if owner else [], [piece])


def replicated(module: nn.Module, optimizer=None, *, owner: bool = True, masters=None) -> State:
    """A whole model (and its optimizer) on this rank; ``owner``: this rank writes it (DP rank 0).

    ``masters``: mixed precision's fp32 master weights (one per trainable parameter, in
    ``module.parameters()`` order, as :func:`minidist.memory_techniques.make_master_params` makes
    them), which ``optimizer`` steps instead of the 16-bit weights. They are saved as
    ``master.<name>``, the optimizer's states under the parameter's name as usual."""
    out = State()
    states = ensure_optimizer_state(optimizer) if optimizer is not None else ()
    named = list(module.named_parameters())
    stepped = {id(p): p for _, p in named}
    if masters is not None:
        masters = list(masters)
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if len(masters) != len(trainable) or any(m.shape != p.shape for m, (_, p) in zip(masters, trainable)):
            raise ValueError(f"{len(masters)} master weights for {len(trainable)} trainable parameters: masters are "
                             "one fp32 copy per trainable parameter, in module.parameters() order")
        stepped = {id(p): m for m, (_, p) in zip(masters, trainable)}
        for m, (name, _) in zip(masters, trainable):
            out += _whole(f"master.{name}", m.detach(), owner)
    for name, p in named:
        out += _whole(name, p, owner)
        q = stepped.get(id(p))
        if optimizer is not None and q is not None and q in optimizer.state:
            for s in states:
                out += _whole(f"optim.{name}.{s}", optimizer.state[q][s], owner)
    return out + (_step_state(optimizer, owner) if optimizer is not None else State())


def flat_sharded(wrapper) -> State:
    """ZeRO-1/2 (``wrapper.buckets``) or ZeRO-3/FSDP (``wrapper.units``): this rank's flat shards.

    The rank writes its slice of the parameters and of the optimizer states. Loading fills the
    same slices; ZeRO-1/2 also fill the whole replicated parameters (they are views of the flat
    buffers whose slice is the shard), so no all-gather is needed after a load."""
    groups = getattr(wrapper, "units", None) or wrapper.buckets
    names = {id(p): n for n, p in wrapper.module.named_parameters()}
    states = ensure_optimizer_state(wrapper.optimizer)
    rank, zero12 = wrapper.rank, not hasattr(wrapper, "units")
    out = State()
    for g in groups:
        lay, lo = g.layout, g.layout.rank * g.layout.shard_numel
        hi = lo + lay.shard_numel
        flats = [("", g.shard.detach())] + [(f".{s}", wrapper.optimizer.state[g.shard][s]) for s in states]
        for p, off, n, shape in zip(g.params, lay.offsets, lay.numels, lay.shapes):
            a, b = max(off, lo), min(off + n, hi)
            name = names[id(p)]
            for suffix, flat in flats:
                key = f"optim.{name}{suffix}" if suffix else name
                pieces = flat_pieces(key, shape, flat[a - lo:b - lo], a - off) if a < b else []
                out.save += pieces
                out.load += pieces if (suffix or not zero12) else []
            if zero12:
                out.load.append(Piece(name, p.detach(), tuple(shape), (0,) * len(shape)))
    sharded = {id(p) for g in groups for p in g.params}
    for name, p in wrapper.module.named_parameters():      # frozen: replicated, rank 0 writes
        if id(p) not in sharded:
            out += _whole(name, p, rank == 0)
    return out + _step_state(wrapper.optimizer, rank == 0)


def _tp_pieces(prefix: str, module: nn.Module, t: int, r: int) -> list[tuple]:
    """(local parameter, rows of it or None, global key, global shape, offsets, owned) of a TP module."""
    from minidist.tensor_parallel import (ColumnParallelLinear, ParallelAttention, RowParallelLinear,
                                          VocabParallelEmbedding)
    out = []
    if isinstance(module, ParallelAttention):
        hd, d = module.head_dim, module.qkv.in_features
        q_rows, kv_rows = module.q_local * hd, module.kv_local * hd
        kv_owner = not module.kv_replicated or r % (t // module.n_kv_heads) == 0
        parts = [("q", 0, q_rows, r * q_rows, module.n_heads * hd, True),
                 ("k", q_rows, kv_rows, module.kv_first * hd, module.n_kv_heads * hd, kv_owner),
                 ("v", q_rows + kv_rows, kv_rows, module.kv_first * hd, module.n_kv_heads * hd, kv_owner)]
        for m, at, n, off, total, own in parts:
            out.append((module.qkv.weight, slice(at, at + n), f"{prefix}{m}.weight", (total, d), (off, 0), own))
            if module.qkv.bias is not None:
                out.append((module.qkv.bias, slice(at, at + n), f"{prefix}{m}.bias", (total,), (off,), own))
        return out + _tp_pieces(prefix + "o.", module.o, t, r)
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        full = (module.out_features, module.in_features)
        dim = 0 if isinstance(module, ColumnParallelLinear) else 1
        off = [0, 0]
        off[dim] = r * full[dim] // t
        out.append((module.weight, None, prefix + "weight", full, tuple(off), True))
        if module.bias is not None:
            out.append((module.bias, None, prefix + "bias", full[:1], (off[0],), dim == 1 and r == 0 or dim == 0))
        return out
    if isinstance(module, VocabParallelEmbedding):
        shape = (module.num_embeddings, module.embedding_dim)
        return [(module.weight, None, prefix + "weight", shape, (module.start, 0), True)]
    for name, p in module.named_parameters(recurse=False):      # a replica (LayerNorm, pos_emb)
        out.append((p, None, prefix + name, tuple(p.shape), (0,) * p.dim(), r == 0))
    for name, child in module.named_children():
        out += _tp_pieces(f"{prefix}{name}.", child, t, r)
    return out


def trainer3d(trainer) -> State:
    """A :class:`~minidist.mesh.Trainer3D` rank: its stage's layers, its TP pieces; DP rank 0 writes."""
    from minidist.mesh import stage_layers
    gpt = trainer.stage.gpt
    layers = stage_layers(trainer.cfg.n_layers, trainer.pp, trainer.i_pp)
    states = ensure_optimizer_state(trainer.optimizer)
    entries = []
    for name in ("tok_emb", "pos_emb", "ln_f", "lm_head"):
        if getattr(gpt, name) is not None:
            entries += _tp_pieces(f"{name}.", getattr(gpt, name), trainer.tp, trainer.i_tp)
    for i, block in enumerate(gpt.blocks):
        entries += _tp_pieces(f"blocks.{layers[i]}.", block, trainer.tp, trainer.i_tp)
    out = State()
    for p, rows, key, shape, offsets, owned in entries:
        owner = owned and trainer.i_dp == 0
        for suffix, t in [("", p.detach())] + [(f".{s}", trainer.optimizer.state[p][s]) for s in states]:
            view = t if rows is None else t[rows]
            out += _whole_at(f"optim.{key}{suffix}" if suffix else key, view, shape, offsets, owner)
    return out + _step_state(trainer.optimizer, trainer.i_dp == 0 and trainer.i_pp == 0 and trainer.i_tp == 0)


def _whole_at(key, view, shape, offsets, owner) -> State:
    piece = Piece(key, view, shape, offsets)
    return State([piece] if owner else [], [piece])


def dtensors(state_dict: dict) -> State:
    """DTensors (Shard/Replicate placements) and plain tensors; a replica is written by mesh coordinate 0."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    out = State()
    for key, t in state_dict.items():
        if not isinstance(t, DTensor):
            out += _whole(key, t, torch.distributed.get_rank() == 0)
            continue
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        coord = t.device_mesh.get_coordinate()
        owner = all(c == 0 for c, pl in zip(coord, t.placements) if isinstance(pl, Replicate))
        out += _whole_at(key, t.to_local(), tuple(t.shape), tuple(offsets), owner)
    return out
