"""Load a checkpoint under any layout: verify it, then fill each target box from the saved boxes.

For each piece this rank must hold (:class:`~minidist.checkpoint.layouts.State`.load) and each
saved shard of the same tensor, the overlap of the two boxes is read from the shard's file and
copied into the piece (:mod:`minidist.checkpoint.pieces`). A rank reads only the shards that
overlap what it holds, and of those only the chunks its overlap touches, each checked against
the CRC-32 recorded at save (:mod:`minidist.checkpoint.reads`): no load reads a whole file to
verify it. Every element of every piece must be filled exactly: a layout that needs a tensor
the checkpoint lacks, or a different global shape, is an error before anything is read.

What can be wrong with a directory, each a :class:`CheckpointError` naming the file:
no ``metadata.json`` (a torn save: the rename makes this impossible for our own saves, but
directories get copied by hand), metadata that is not JSON or not ours (a foreign
checkpoint), a file missing, shorter or longer than recorded (truncated), or whose bytes
differ (corrupted). :func:`verify` checks every file's SHA-256 (reading it whole);
:func:`latest` returns the newest directory that passes :func:`verify`.
"""
from __future__ import annotations

import json
import math
import os

import torch

from minidist.checkpoint.layouts import State
from minidist.checkpoint.pieces import box_slices, intersect
from minidist.checkpoint.reads import Reader
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


def load(path: str, state: State, *, verify_files: bool = True, stats: dict | None = None) -> dict:
    """Fill every piece of ``state.load`` from checkpoint ``path``; returns the saved ``extra``
    (with ``step`` added). Every rank calls it for its own pieces; no rank communicates.

    Only the chunks of the saved pieces that overlap this rank's pieces are read, each once, and
    (``verify_files``) checked against its CRC-32 (:mod:`~minidist.checkpoint.reads`); a piece
    whose random state or other ``rng.`` key the checkpoint lacks is left as it is (``loaded``
    False). ``stats``: a dict that receives ``bytes_read`` (headers included), ``by_file`` and
    ``reads`` (the number of reads)."""
    meta = read_metadata(path)
    todo = []
    for piece in state.load:
        piece.loaded = False
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
    # The plan first: which saved shard fills which part of which piece; every element accounted
    # for before a byte is read.
    by_shard: dict[tuple, tuple[dict, list]] = {}
    for piece, t in todo:
        filled = 0
        for i, s in enumerate(t["shards"]):
            box = intersect(s["offsets"], s["lengths"], piece.offsets, piece.lengths)
            if box is None:
                continue
            by_shard.setdefault((s["file"], piece.key, i), (s, []))[1].append((piece, box))
            filled += math.prod(box[1])
        if filled != piece.tensor.numel():
            raise CheckpointError(f"{piece.key}: the checkpoint's shards fill {filled} of the {piece.tensor.numel()} "
                                  f"elements this rank needs at {piece.offsets}")
    reader = Reader(path, meta["files"], CheckpointError, verify_files)
    try:
        for _, (s, jobs) in sorted(by_shard.items(), key=lambda kv: kv[0]):
            for (piece, box), src in zip(jobs, reader.read_boxes(s, [box for _, box in jobs])):
                dst = piece.tensor[box_slices(*box, piece.offsets)] if piece.global_shape else piece.tensor
                with torch.no_grad():
                    dst.copy_(src.to(dst.dtype))
    finally:
        reader.close()
    for piece, _ in todo:
        piece.loaded = True
    if stats is not None:
        stats.update(bytes_read=reader.bytes_read, by_file=dict(reader.by_file), reads=reader.reads)
    for fn in state.after_load:
        fn()
    return dict(meta["extra"], step=meta["step"])
