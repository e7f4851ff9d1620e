"""Sharded, atomic, optionally asynchronous save.

Every rank writes only the pieces it owns (:class:`~minidist.checkpoint.layouts.State`.save)
into its own safetensors file (raw tensors and a JSON header: nothing is ever unpickled), then
a small ``rank<r>.json`` naming what the file holds, its SHA-256, and a CRC-32 of every
``chunk_bytes`` of each piece (so a load that reads part of a piece verifies just those bytes:
:mod:`~minidist.checkpoint.reads`). Rank 0 waits for all N of
those, writes ``metadata.json`` last (every tensor's global shape and dtype, and per shard its
rank, offsets, lengths and file), and makes the checkpoint visible with **one rename** of the
temporary directory ``.tmp-step_<n>`` to ``step_<n>``. A crash at any moment before that
rename leaves the previous checkpoint as the newest one; no reader ever looks into ``.tmp-*``.

Asynchronous save (as in Check-N-Run and torch DCP's ``async_save``): the only work on the
training thread is the copy of this rank's pieces to host memory (the state may change as
soon as the next step starts); the files are written by a background thread while training
goes on. :meth:`Pending.wait` joins it. No collective runs in the thread: rank 0 learns that
the others finished from their ``rank<r>.json`` files, so the thread never races the
training loop's own collectives.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import zlib

import torch
import torch.distributed as dist

from minidist.checkpoint.layouts import State

__all__ = ["FORMAT", "CHUNK_BYTES", "save", "Pending", "checkpoint_dir", "file_digest", "chunk_crcs"]

FORMAT = "minidist-checkpoint/2"     # /2: a CRC-32 per chunk of every piece
COMMIT_TIMEOUT = 120.0      # seconds rank 0 waits for the other ranks' files
# A load reads and verifies whole chunks: smaller ones read less around a partial box, but list
# more checksums (1 MiB: 1024 numbers per GiB of checkpoint in the metadata).
CHUNK_BYTES = 1 << 20


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: str, obj) -> None:
    """Written to a side file and renamed: a reader sees the whole JSON or none of it."""
    with open(path + ".part", "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def _host_copy(state: State) -> list[tuple[str, torch.Tensor, tuple, tuple]]:
    """This rank's pieces copied to host memory: the only work an async save does in the foreground."""
    return [(p.key, p.tensor.detach().to("cpu", copy=True).contiguous(), p.global_shape, p.offsets) for p in state.save]


# The safetensors layout (github.com/huggingface/safetensors): an 8-byte little-endian header
# length, a JSON header (per tensor: dtype, shape, [begin, end) in the data), then the raw bytes.
# Written here with plain file writes, which release the GIL while the bytes go out, so an
# async save's thread does not hold up the training thread; safetensors itself reads it.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    header, at = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be checkpointed")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for t in tensors.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def chunk_crcs(t: torch.Tensor, chunk_bytes: int) -> list[int]:
    """CRC-32 of each ``chunk_bytes`` of a contiguous host tensor's bytes (the last chunk shorter)."""
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return [zlib.crc32(data[at:at + chunk_bytes]) for at in range(0, len(data), chunk_bytes)]


def _write_rank(tmp: str, rank: int, token: str, pieces, chunk_bytes: int, fault=None) -> None:
    fname = f"rank{rank:05d}.safetensors"
    tensors, shards = {}, []
    for key, t, shape, offsets in pieces:
        name = f"{key}@{','.join(map(str, offsets))}"
        tensors[name] = t
        shards.append({"key": key, "name": name, "shape": list(shape), "offsets": list(offsets),
                       "lengths": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                       "chunk_bytes": chunk_bytes, "crc32": chunk_crcs(t, chunk_bytes)})
    path = os.path.join(tmp, fname)
    write_safetensors(path, tensors, {"format": FORMAT, "token": token})
    if fault is not None:
        fault("after_file")         # tests: a rank that dies with its file written, its record not
    _write_json(os.path.join(tmp, f"rank{rank:05d}.json"),
                {"rank": rank, "token": token, "file": fname, "sha256": file_digest(path),
                 "bytes": os.path.getsize(path), "shards": shards})


def _commit(tmp: str, final: str, world: int, token: str, step: int, extra: dict, keep: int | None) -> None:
    """Rank 0: wait for every rank's record, check the shards tile every tensor, write the metadata, rename."""
    records, deadline = {}, time.monotonic() + COMMIT_TIMEOUT
    while len(records) < world:
        for r in range(world):
            path = os.path.join(tmp, f"rank{r:05d}.json")
            if r not in records and os.path.exists(path):
                with open(path) as f:
                    rec = json.load(f)
                if rec["token"] == token:
                    records[r] = rec
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(records))
            raise TimeoutError(f"checkpoint {final}: ranks {missing} did not finish writing within {COMMIT_TIMEOUT:g} s")
        time.sleep(0.005)
    tensors, files = {}, {}
    for r, rec in sorted(records.items()):
        files[rec["file"]] = {"rank": r, "sha256": rec["sha256"], "bytes": rec["bytes"]}
        for s in rec["shards"]:
            t = tensors.setdefault(s["key"], {"shape": s["shape"], "dtype": s["dtype"], "shards": []})
            if t["shape"] != s["shape"] or t["dtype"] != s["dtype"]:
                raise ValueError(f"{s['key']}: rank {r} saved it as {s['dtype']}{s['shape']}, "
                                 f"another rank as {t['dtype']}{t['shape']}")
            t["shards"].append({"rank": r, "file": rec["file"], "name": s["name"], "offsets": s["offsets"],
                                "lengths": s["lengths"], "chunk_bytes": s["chunk_bytes"], "crc32": s["crc32"]})
    for key, t in tensors.items():      # owners must tile each tensor exactly once
        held = sum(_numel(s["lengths"]) for s in t["shards"])
        if held != _numel(t["shape"]):
            raise ValueError(f"{key}: the saved shards hold {held} elements of a tensor of {_numel(t['shape'])} "
                             f"({'some written twice' if held > _numel(t['shape']) else 'some never written'}): "
                             "each element must have exactly one owner")
    _write_json(os.path.join(tmp, "metadata.json"), {"format": FORMAT, "step": step, "world_size": world,
                                                     "token": token, "tensors": tensors, "files": files,
                                                     "extra": extra})
    if os.path.exists(final):           # the same step saved again after a restart
        shutil.rmtree(final)
    os.rename(tmp, final)               # the commit point
    root = os.path.dirname(final)
    for d in os.listdir(root):          # what crashed saves left behind (one save is in flight at a time)
        if d.startswith(".tmp-step_"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    if keep:
        done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for old in done[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class Pending:
    """A save in flight. ``wait()`` returns the committed directory on rank 0 (None elsewhere)
    and re-raises what the writer thread raised."""

    def __init__(self, target, final: str, rank: int):
        self.final, self.rank, self.error = final, rank, None
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True, name="minidist-ckpt")
        self._thread.start()

    def _run(self, target):
        try:
            target()
        except BaseException as err:        # handed to wait(): a thread's exception is otherwise lost
            self.error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.final if self.rank == 0 else None


def save(root: str, state: State, step: int, *, extra: dict | None = None, group=None,
         blocking: bool = True, keep: int | None = None, chunk_bytes: int = CHUNK_BYTES, fault=None):
    """Save this rank's pieces of ``state`` as checkpoint ``root/step_<step>``; every rank calls it.

    ``blocking=True``: returns once the checkpoint is committed and visible on every rank.
    ``blocking=False``: returns a :class:`Pending` right after the host copy; call ``wait()``
    before the next save. ``extra``: plain JSON data from rank 0 (data position, loss scale).
    ``keep``: delete all but the newest ``keep`` checkpoints after the commit. ``chunk_bytes``:
    the granularity of the checksums a partial load verifies (a multiple of 8). ``fault``: tests'
    hook, called with "after_file"."""
    from minidist.collectives.p2p import group_info
    from minidist.runtime.device import device as rank_device
    rank, world = group_info(group)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    json.dumps(extra or {})         # plain JSON or a clear error now, not in the thread
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 8 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8 (whole elements), got {chunk_bytes!r}")
    # One number agreed by all ranks names this attempt: a record left by a crashed earlier
    # save of the same step cannot be mistaken for this one's.
    # (os.urandom, not torch's generator: a save must not move the training's random stream)
    token = torch.tensor([int.from_bytes(os.urandom(7), "little") if rank == 0 else 0], dtype=torch.int64,
                         device=rank_device())
    dist.broadcast(token, group=group, group_src=0)
    token = f"{int(token.item()):x}"
    final = checkpoint_dir(root, step)
    tmp = os.path.join(root, f".tmp-step_{step:08d}-{token}")
    os.makedirs(tmp, exist_ok=True)
    pieces = _host_copy(state)

    def write():
        _write_rank(tmp, rank, token, pieces, chunk_bytes, fault)
        if rank == 0:
            _commit(tmp, final, world, token, step, extra or {}, keep)

    pending = Pending(write, final, rank)
    if not blocking:
        return pending
    pending.wait()
    dist.barrier(group=group)       # nobody goes on before the commit
    return final
