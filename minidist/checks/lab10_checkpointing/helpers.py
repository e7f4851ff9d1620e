"""Lab 10's helpers, handed out by the notebook's setup cell (``box, split_range, sha256_of =
checks.box, checks.split_range, checks.sha256_of``): the box arithmetic of the lab's layouts and a
file's checksum. The verdicts compute with them too.

A layout is ``{"kind": "rows" | "cols" | "replicated", "world": N}``: rank r holds rows (dim 0) or
columns (the last dim) ``tensor_split`` chunk r, or the whole tensor.
"""
from __future__ import annotations

import hashlib


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


def sha256_of(path: str) -> str:
    """The SHA-256 of the file at ``path``, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
