"""Lab 10's reference: the lab's checkpoint format written and judged in one process.

The format the lab hands out (Megatron's and torch DCP's, cut down): one directory per checkpoint,
``rank<r>.safetensors`` per rank that owns something (each tensor's piece under the tensor's name),
and ``metadata.json``, written last::

    {"tensors": {name: {"shape": [...], "dtype": "float32",
                        "shards": [{"rank": r, "file": "rank<r>.safetensors", "offsets": [...], "lengths": [...]}]}},
     "files": {"rank<r>.safetensors": {"bytes": n, "sha256": "..."}}}

A layout is ``{"kind": "rows" | "cols" | "replicated", "world": N}``: rank r holds rows (dim 0) or
columns (the last dim) ``tensor_split`` chunk r, or the whole tensor; a replicated tensor is
written by rank 0 only. The checks build their checkpoints with :func:`write`, so no graded
function depends on another.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

KINDS = ("rows", "cols", "replicated")


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of chunk ``rank`` when n items are cut into ``world`` (torch.tensor_split)."""
    q, rem = divmod(n, world)
    start = rank * q + min(rank, rem)
    return start, start + q + (rank < rem)


def box(shape, layout: dict, rank: int) -> tuple[list[int], list[int]]:
    """(offsets, lengths) of the piece rank ``rank`` holds under ``layout`` (replicated: all of it)."""
    offsets, lengths = [0] * len(shape), list(shape)
    if layout["kind"] != "replicated" and shape:
        dim = 0 if layout["kind"] == "rows" else len(shape) - 1
        a, b = split_range(shape[dim], layout["world"], rank)
        offsets[dim], lengths[dim] = a, b - a
    return offsets, lengths


def owns(layout: dict, rank: int) -> bool:
    """Whether ``rank`` writes its piece (a replicated tensor: rank 0 only)."""
    return layout["kind"] != "replicated" or rank == 0


def piece(full: torch.Tensor, offsets, lengths) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write(state: dict, layout: dict, path: str) -> None:
    """The reference save (no temporary directory: the checks write where nothing can crash)."""
    from safetensors.torch import save_file
    os.makedirs(path)
    meta = {"tensors": {}, "files": {}}
    per_rank: dict[int, dict] = {}
    for name, t in state.items():
        entry = meta["tensors"][name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                         "shards": []}
        for r in range(layout["world"]):
            offsets, lengths = box(t.shape, layout, r)
            if owns(layout, r) and all(lengths):
                per_rank.setdefault(r, {})[name] = piece(t, offsets, lengths).contiguous()
                entry["shards"].append({"rank": r, "file": f"rank{r}.safetensors", "offsets": offsets,
                                        "lengths": lengths})
    for r, tensors in per_rank.items():
        f = os.path.join(path, f"rank{r}.safetensors")
        save_file(tensors, f)
        meta["files"][f"rank{r}.safetensors"] = {"bytes": os.path.getsize(f), "sha256": sha256_of(f)}
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)


def damage(path: str, how: str) -> None:
    """What a crash or a disk leaves behind: ``torn`` (no metadata), ``truncated`` (a file cut short),
    ``corrupted`` (a byte flipped, same size), ``garbled`` (metadata that is not JSON)."""
    meta_path = os.path.join(path, "metadata.json")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if how == "torn":
        os.remove(meta_path)
    elif how == "truncated":
        f = os.path.join(path, files[-1])
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 4)
    elif how == "corrupted":
        f = os.path.join(path, files[0])
        data = bytearray(open(f, "rb").read())
        data[-2] ^= 0xFF
        open(f, "wb").write(bytes(data))
    elif how == "garbled":
        with open(meta_path, "w") as fh:
            fh.write('{"tensors": {')
    elif how != "good":
        raise ValueError(f"unknown damage {how!r}")
