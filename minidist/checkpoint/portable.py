"""The portable format: a sharded checkpoint that any program reads with safetensors and json alone.

minidist's own checkpoints (:mod:`~minidist.checkpoint.save`) name every piece by its tensor and
offsets, and carry a format tag, a step, a save token and ``extra``. The portable format is the
cut-down one lab 10 teaches (the shape of Megatron's and torch DCP's sharded checkpoints, without
their machinery). :func:`save_portable` writes a full state in it, :func:`export_portable` converts
one of ours into it, :func:`load_portable` reads any rank's piece back (the full state under
``{"kind": "replicated", "world": 1}``), as torch DCP's format converters do for ``torch.save``
files. One directory per checkpoint::

    rank<r>.safetensors   per rank that owns a piece: each tensor's piece under the tensor's name
    metadata.json         {"tensors": {name: {"shape": [...], "dtype": "float32",
                                             "shards": [{"rank": r, "file": "rank<r>.safetensors",
                                                         "offsets": [...], "lengths": [...]}]}},
                           "files": {"rank<r>.safetensors": {"bytes": n, "sha256": "..."}}}

A simple layout is ``{"kind": "rows" | "cols" | "replicated", "world": N}``: rank r holds chunk r
of ``torch.tensor_split`` along dim 0 (rows) or the last dim (cols), or the whole tensor (a replica,
written by rank 0 only; so is a 0-dim tensor). :func:`save_portable` writes in a temporary
directory beside ``path`` and renames it, so ``path`` appears complete or not at all.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from minidist.checkpoint.layouts import State
from minidist.checkpoint.load import CheckpointError, load, read_metadata
from minidist.checkpoint.pieces import Piece, box_slices, intersect
from minidist.checkpoint.save import file_digest, write_safetensors

__all__ = ["KINDS", "chunk_range", "layout_box", "owned_pieces", "save_portable", "verify_portable",
           "load_portable", "export_portable"]

KINDS = ("rows", "cols", "replicated")


def _check_layout(layout) -> None:
    if not isinstance(layout, dict) or layout.get("kind") not in KINDS:
        raise ValueError(f"a layout is {{'kind': one of {KINDS}, 'world': N}}, not {layout!r}")
    if not isinstance(layout.get("world"), int) or layout["world"] < 1:
        raise ValueError(f"a layout's world must be an int >= 1, not {layout.get('world')!r}")


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of chunk ``rank`` when n items are cut into ``world`` chunks as
    ``torch.tensor_split`` cuts them (the first n % world chunks one item longer)."""
    q, extra = divmod(n, world)
    start = rank * q + min(rank, extra)
    return start, start + q + (rank < extra)


def layout_box(shape, layout: dict, rank: int) -> tuple[tuple, tuple]:
    """(offsets, lengths) of what rank ``rank`` holds of a tensor of ``shape`` under ``layout``."""
    _check_layout(layout)
    if not 0 <= rank < layout["world"]:
        raise ValueError(f"rank {rank} is not in a layout of {layout['world']} ranks")
    shape = tuple(int(s) for s in shape)
    offsets, lengths = [0] * len(shape), list(shape)
    if layout["kind"] != "replicated" and shape:
        dim = 0 if layout["kind"] == "rows" else len(shape) - 1
        start, stop = chunk_range(shape[dim], layout["world"], rank)
        offsets[dim], lengths[dim] = start, stop - start
    return tuple(offsets), tuple(lengths)


def owned_pieces(state: dict, layout: dict) -> dict[int, list[Piece]]:
    """rank -> the pieces it writes: its box of every tensor, unless the box is empty or the tensor
    is a replica (then rank 0 alone writes it, as one copy)."""
    _check_layout(layout)
    out: dict[int, list[Piece]] = {}
    for name, full in state.items():
        if not isinstance(full, torch.Tensor):
            raise TypeError(f"{name}: a state holds tensors, not {type(full).__name__}")
        one_copy = layout["kind"] == "replicated" or full.dim() == 0
        for rank in range(1 if one_copy else layout["world"]):
            offsets, lengths = layout_box(full.shape, layout, rank) if not one_copy else ((0,) * full.dim(), full.shape)
            if all(lengths):
                view = full[box_slices(offsets, lengths, (0,) * full.dim())]
                out.setdefault(rank, []).append(Piece(name, view, full.shape, offsets))
    return out


def save_portable(state: dict, layout: dict, path: str) -> str:
    """Write the full tensors of ``state`` (name -> tensor) as checkpoint ``path`` in the portable
    format, each rank's pieces under ``layout`` in its own file; returns ``path``."""
    by_rank = owned_pieces(state, layout)
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists: a checkpoint is written once (remove it first)")
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.path.basename(path)}-{os.urandom(4).hex()}")
    os.makedirs(tmp)
    try:
        meta = {"tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "shards": []}
                            for name, t in state.items()}, "files": {}}
        for rank, pieces in sorted(by_rank.items()):
            fname = f"rank{rank}.safetensors"
            write_safetensors(os.path.join(tmp, fname),
                              {p.key: p.tensor.detach().to("cpu", copy=True).contiguous() for p in pieces}, {})
            meta["files"][fname] = {"bytes": os.path.getsize(os.path.join(tmp, fname)),
                                    "sha256": file_digest(os.path.join(tmp, fname))}
            for p in pieces:
                meta["tensors"][p.key]["shards"].append({"rank": rank, "file": fname, "offsets": list(p.offsets),
                                                         "lengths": list(p.lengths)})
        with open(os.path.join(tmp, "metadata.json"), "w") as f:  # last: its presence means complete
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)                                        # the commit
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def verify_portable(path: str) -> dict:
    """The metadata of portable checkpoint ``path`` once every file it lists has its recorded size and
    SHA-256; a :class:`CheckpointError` naming what is wrong otherwise (torn, garbled, truncated,
    corrupted)."""
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{meta_path} is missing: a torn checkpoint (the metadata is written last)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_path} is not valid JSON ({err}): a torn or corrupted checkpoint") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("tensors"), dict) and isinstance(meta.get("files"), dict)):
        raise CheckpointError(f"{meta_path} holds no 'tensors' and 'files': not a portable checkpoint")
    for name, rec in meta["files"].items():
        full = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing (the metadata lists it)")
        if os.path.getsize(full) != rec["bytes"]:
            raise CheckpointError(f"{full} has {os.path.getsize(full)} bytes, the metadata says {rec['bytes']}: "
                                  "a truncated file")
        if file_digest(full) != rec["sha256"]:
            raise CheckpointError(f"{full}: SHA-256 differs from the metadata's: a corrupted file")
    return meta


def load_portable(path: str, layout: dict, rank: int) -> dict[str, torch.Tensor]:
    """{name: rank ``rank``'s piece under ``layout``} from portable checkpoint ``path``, whatever layout
    wrote it (verified first): each saved shard that overlaps the piece is read, the overlap only."""
    from safetensors import safe_open
    meta = verify_portable(path)
    out = {}
    for name, t in meta["tensors"].items():
        shape = tuple(t["shape"])
        offsets, lengths = layout_box(shape, layout, rank)
        mine = torch.empty(lengths, dtype=getattr(torch, t["dtype"]), device="cpu")   # file bytes: host memory
        filled = 0
        for s in t["shards"]:
            box = intersect(s["offsets"], s["lengths"], offsets, lengths)
            if box is None:
                continue
            with safe_open(os.path.join(path, s["file"]), framework="pt") as f, torch.device("cpu"):
                src = f.get_slice(name)[box_slices(*box, s["offsets"])] if shape else f.get_tensor(name)
            mine[box_slices(*box, offsets)] = src
            filled += src.numel()
        if filled != mine.numel():
            raise CheckpointError(f"{name}: the shards in {path} fill {filled} of the {mine.numel()} elements "
                                  f"rank {rank} holds at {list(offsets)}")
        out[name] = mine
    return out


def export_portable(native_path: str, path: str, layout: dict) -> str:
    """Convert minidist checkpoint ``native_path`` (any layout saved it) to the portable format at
    ``path`` under ``layout``; its tensors only (``extra`` and the step stay behind). Returns ``path``."""
    _check_layout(layout)
    meta = read_metadata(native_path)
    full = {key: torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]), device="cpu")
            for key, t in meta["tensors"].items()}
    load(native_path, State(load=[Piece(key, t, t.shape, (0,) * t.dim()) for key, t in full.items()]))
    return save_portable(full, layout, path)
