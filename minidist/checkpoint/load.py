"""Load a checkpoint under any layout: verify it, then fill each target box from the saved boxes.

For each piece this rank must hold (:class:`~minidist.checkpoint.layouts.State`.load) and each
saved shard of the same tensor, the overlap of the two boxes is read from the shard's file and
copied into the piece (:mod:`minidist.checkpoint.pieces`). safetensors files are memory-mapped
and sliced, so a rank reads only the shards that overlap what it holds, and of those only the
rows it needs; the SHA-256 of a file is checked the first time a rank opens it
(``verify=False`` skips that read). Every element of every piece must be filled exactly: a
layout that needs a tensor the checkpoint lacks, or a different global shape, is an error
before anything is copied.

What can be wrong with a directory, each a :class:`CheckpointError` naming the file:
no ``metadata.json`` (a torn save: the rename makes this impossible for our own saves, but
directories get copied by hand), metadata that is not JSON or not ours (a foreign
checkpoint), a file missing, shorter or longer than recorded (truncated), or whose bytes
differ (corrupted). :func:`latest` returns the newest directory that passes all of these.
"""
from __future__ import annotations

import json
import os

import torch

from minidist.checkpoint.layouts import State
from minidist.checkpoint.pieces import box_slices, intersect
from minidist.checkpoint.save import FORMAT, file_digest

__all__ = ["CheckpointError", "read_metadata", "verify", "latest", "load"]

OPTIONAL = ("rng.",)        # per-rank random states: restored only where that rank exists again


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (torn, truncated, corrupted, foreign, incompatible)."""


def read_metadata(path: str) -> dict:
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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: format {found!r} is not {FORMAT!r}: not a minidist checkpoint")
    return meta


def _check_file(path: str, name: str, rec: dict, digest: bool) -> None:
    full = os.path.join(path, name)
    if not os.path.exists(full):
        raise CheckpointError(f"{full} is missing (the metadata lists it)")
    size = os.path.getsize(full)
    if size != rec["bytes"]:
        raise CheckpointError(f"{full} has {size} bytes, the metadata says {rec['bytes']}: a truncated file")
    if digest and file_digest(full) != rec["sha256"]:
        raise CheckpointError(f"{full}: SHA-256 differs from the metadata's: a corrupted file")


def verify(path: str) -> dict:
    """The metadata, once every file it lists is present, of its size and checksum."""
    meta = read_metadata(path)
    for name, rec in meta["files"].items():
        _check_file(path, name, rec, True)
    return meta


def latest(root: str) -> str | None:
    """The newest ``root/step_*`` that verifies (older ones are tried when a newer one is bad)."""
    if not os.path.isdir(root):
        return None
    for d in sorted((d for d in os.listdir(root) if d.startswith("step_")), reverse=True):
        try:
            verify(os.path.join(root, d))
            return os.path.join(root, d)
        except CheckpointError:
            continue
    return None


def load(path: str, state: State, *, verify_files: bool = True) -> dict:
    """Fill every piece of ``state.load`` from checkpoint ``path``; returns the saved ``extra``
    (with ``step`` added). Every rank calls it for its own pieces; no rank communicates."""
    from safetensors import safe_open
    meta = read_metadata(path)
    todo = []
    for piece in state.load:
        t = meta["tensors"].get(piece.key)
        if t is None:
            if piece.key.startswith(OPTIONAL):
                continue
            raise CheckpointError(f"{path} has no tensor {piece.key!r} (it holds {len(meta['tensors'])} tensors, "
                                  f"e.g. {sorted(meta['tensors'])[:3]}): another model or optimizer?")
        if tuple(t["shape"]) != piece.global_shape:
            raise CheckpointError(f"{piece.key}: saved with global shape {tuple(t['shape'])}, this layout "
                                  f"expects {piece.global_shape}")
        todo.append((piece, t))
    opened = {}

    def handle(name):
        if name not in opened:
            _check_file(path, name, meta["files"][name], verify_files)
            opened[name] = safe_open(os.path.join(path, name), framework="pt")
        return opened[name]

    for piece, t in todo:
        filled = 0
        for s in t["shards"]:
            box = intersect(s["offsets"], s["lengths"], piece.offsets, piece.lengths)
            if box is None:
                continue
            f = handle(s["file"])
            with torch.device("cpu"):       # bytes read from a file are host memory, whatever the default device
                if not piece.global_shape:
                    src = f.get_tensor(s["name"])
                else:
                    src = f.get_slice(s["name"])[box_slices(*box, s["offsets"])]
            dst = piece.tensor[box_slices(*box, piece.offsets)] if piece.global_shape else piece.tensor
            with torch.no_grad():
                dst.copy_(src.to(dst.dtype))
            filled += src.numel()
        if filled != piece.tensor.numel():
            raise CheckpointError(f"{piece.key}: the checkpoint's shards fill {filled} of the {piece.tensor.numel()} "
                                  f"elements this rank needs at {piece.offsets}")
    for fn in state.after_load:
        fn()
    return dict(meta["extra"], step=meta["step"])
