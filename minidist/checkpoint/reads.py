"""Read only the bytes a box needs from a saved piece, and verify just those bytes.

A saved piece (a shard) is a row-major block of a safetensors file. The part of it a rank
needs, a sub-box, is a set of contiguous *runs*: find the innermost dimension the sub-box does
not cover whole; every dimension after it is whole, so each index of the dimensions before it
starts one run of ``l[d]·∏L[d+1:]`` elements. Cut by rows (dimension 0), a sub-box is one run:
a contiguous range of the piece. Cut by columns, it is one run per row, strided.

Integrity without reading whole files: at save time every piece's bytes got a CRC-32 per
``chunk_bytes`` (:func:`minidist.checkpoint.save.chunk_crcs`). A load reads every chunk that one
of its runs touches, whole (consecutive chunks in one read), and checks each chunk's CRC. So a
rows cut reads its range rounded out to chunks; a columns cut reads every chunk holding a needed
row segment: when rows are shorter than a chunk that is the whole piece, when they are longer
about the needed share of it. The whole-file SHA-256 stays the job of
:func:`~minidist.checkpoint.load.verify` and :func:`~minidist.checkpoint.load.latest`. CRC-32
detects accidental damage (torn writes, truncation, flipped bits), not a deliberate forgery.

:class:`Reader` holds a checkpoint's open files for one load and counts what it read
(``bytes_read``, per file and in all, headers included).
"""
from __future__ import annotations

import json
import math
import os
import zlib

import torch

__all__ = ["runs", "touched_chunks", "Reader"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _strides(lengths) -> list[int]:
    out, n = [], 1
    for s in reversed(lengths):
        out.append(n)
        n *= s
    return out[::-1]


def runs(lengths, offsets, sub_lengths) -> tuple[torch.Tensor, int]:
    """The contiguous runs of sub-box (``offsets``, ``sub_lengths``) of a row-major block of shape
    ``lengths``: (first element of each run, as an int64 CPU tensor; elements per run)."""
    lengths, offsets, sub = list(lengths), list(offsets), list(sub_lengths)
    strides = _strides(lengths)
    d = len(lengths) - 1
    while d >= 0 and sub[d] == lengths[d]:
        d -= 1
    if d < 0:                                   # the whole block
        return torch.zeros(1, dtype=torch.int64, device="cpu"), math.prod(lengths)
    run = sub[d] * math.prod(lengths[d + 1:])
    starts = torch.full((1,), offsets[d] * strides[d], dtype=torch.int64, device="cpu")
    for i in range(d - 1, -1, -1):              # every index of the dimensions before d
        idx = (offsets[i] + torch.arange(sub[i], dtype=torch.int64, device="cpu")) * strides[i]
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return starts, run


def touched_chunks(starts: torch.Tensor, run: int, item: int, chunk: int, n_chunks: int) -> torch.Tensor:
    """A bool mask over a piece's chunks: those that hold a byte of any run."""
    first = (starts * item) // chunk
    last = ((starts + run) * item - 1) // chunk
    marks = torch.zeros(n_chunks + 1, dtype=torch.int64, device="cpu")
    marks.index_add_(0, first, torch.ones_like(first))
    marks.index_add_(0, last + 1, -torch.ones_like(last))
    return marks.cumsum(0)[:n_chunks] > 0


class Reader:
    """The files of checkpoint ``path`` for one load; ``bytes_read`` and ``by_file`` count every
    byte read. ``error``: the exception class to raise (the loader's CheckpointError)."""

    def __init__(self, path: str, files: dict, error, verify: bool = True):
        self.path, self.files, self.error, self.verify = path, files, error, verify
        self.bytes_read, self.by_file, self.reads = 0, {}, 0
        self._fds, self._headers = {}, {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _pread(self, name: str, n: int, at: int) -> bytes:
        data = os.pread(self._fds[name], n, at)
        self.bytes_read += len(data)
        self.by_file[name] = self.by_file.get(name, 0) + len(data)
        self.reads += 1
        if len(data) != n:
            raise self.error(f"{os.path.join(self.path, name)} ends at byte {at + len(data)}, before byte {at + n} "
                             "that the checkpoint needs: a truncated file")
        return data

    def _open(self, name: str) -> tuple[dict, int]:
        """(the file's safetensors header, where its data starts) (opened once; its size checked against the metadata first)."""
        if name in self._headers:
            return self._headers[name]
        full = os.path.join(self.path, name)
        rec = self.files.get(name)
        if rec is None or not os.path.exists(full):
            raise self.error(f"{full} is missing (the metadata lists it)")
        size = os.path.getsize(full)
        if size != rec["bytes"]:
            raise self.error(f"{full} has {size} bytes, the metadata says {rec['bytes']}: a truncated file")
        self._fds[name] = os.open(full, os.O_RDONLY)
        n = int.from_bytes(self._pread(name, 8, 0), "little")
        if not 0 < n <= size - 8:
            raise self.error(f"{full}: a header of {n} bytes in a file of {size}: not a safetensors file")
        try:
            header = json.loads(self._pread(name, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self.error(f"{full}: its safetensors header is not JSON: a corrupted file") from None
        self._headers[name] = (header, 8 + n)
        return self._headers[name]

    def _entry(self, shard: dict) -> tuple[torch.dtype, int, int]:
        """(dtype, byte offset of the piece in the file, its bytes), the header checked against the metadata."""
        header, data_at = self._open(shard["file"])
        entry = header.get(shard["name"])
        where = f"{os.path.join(self.path, shard['file'])}: {shard['name']}"
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise self.error(f"{where} is not in the file's header: a corrupted or foreign file")
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        nbytes = math.prod(shard["lengths"]) * dtype.itemsize
        if entry["shape"] != list(shard["lengths"]) or end - begin != nbytes:
            raise self.error(f"{where}: the header says shape {entry['shape']} ({end - begin} bytes), the metadata "
                             f"{shard['lengths']}: a corrupted file")
        return dtype, data_at + begin, nbytes

    def read_box(self, shard: dict, box_offsets, box_lengths) -> torch.Tensor:
        """The sub-box (global ``box_offsets``, ``box_lengths``) of saved ``shard``, a CPU tensor,
        read chunk by chunk and each chunk read verified."""
        return self.read_boxes(shard, [(box_offsets, box_lengths)])[0]

    def read_boxes(self, shard: dict, boxes) -> list[torch.Tensor]:
        """Several sub-boxes of one shard, each touched chunk read once."""
        dtype, at, nbytes = self._entry(shard)
        chunk, item, lengths = shard["chunk_bytes"], dtype.itemsize, shard["lengths"]
        crcs = shard["crc32"]
        n_chunks = len(crcs)
        if n_chunks != -(-nbytes // chunk):
            raise self.error(f"{os.path.join(self.path, shard['file'])}: {shard['name']} has {n_chunks} checksums "
                             f"for {nbytes} bytes in chunks of {chunk}: a corrupted metadata.json")
        plans, need = [], torch.zeros(n_chunks, dtype=torch.bool, device="cpu")
        for off, ln in boxes:
            local = [o - s for o, s in zip(off, shard["offsets"])]
            starts, run = runs(lengths, local, ln)
            need |= touched_chunks(starts, run, item, chunk, n_chunks)
            plans.append((local, ln))
        idx = need.nonzero().flatten().tolist()
        lo, hi = idx[0], idx[-1] + 1                   # the buffer covers chunks [lo, hi)
        buf = bytearray((min(hi * chunk, nbytes)) - lo * chunk)
        i = 0
        while i < len(idx):                            # one read per stretch of consecutive chunks
            j = i
            while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
                j += 1
            a, b = idx[i] * chunk, min((idx[j] + 1) * chunk, nbytes)
            data = self._pread(shard["file"], b - a, at + a)
            buf[a - lo * chunk:b - lo * chunk] = data
            if self.verify:
                for c in range(idx[i], idx[j] + 1):
                    part = data[c * chunk - a:min((c + 1) * chunk, nbytes) - a]
                    if zlib.crc32(part) != crcs[c]:
                        raise self.error(f"{os.path.join(self.path, shard['file'])}: bytes [{c * chunk}, "
                                         f"{c * chunk + len(part)}) of {shard['name']} differ from their CRC-32 "
                                         "recorded at save: a corrupted file")
            i = j + 1
        flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype, device="cpu")
        strides, base = _strides(lengths), lo * chunk // item
        out = []
        for local, ln in plans:
            first = sum(o * s for o, s in zip(local, strides)) - base
            out.append(flat.as_strided(tuple(ln), tuple(strides), first))
        return out
