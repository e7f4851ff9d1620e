"""The checkpoints lab 10's checks start from: written by the library's portable writer
(:func:`minidist.checkpoint.portable.save_portable`, the lab's format), then damaged the way a
crash or a disk damages one. Each case's root is built here before the student's code runs, outside
the refusal (the check's ``reference(case)``), so no graded function depends on another; the whole
module is refused while graded code runs (``REFUSED``)."""
from __future__ import annotations

import os
import tempfile

from minidist.checkpoint import portable
from minidist.checks.lab10_checkpointing.cases import state_of


def write(state: dict, layout: dict, path: str) -> None:
    """``state`` (name -> full tensor) written as checkpoint ``path`` under ``layout``: the library's."""
    portable.save_portable(state, layout, path)


def damage(path: str, how: str) -> None:
    """What a crash or a disk leaves behind: ``torn`` (no metadata), ``truncated`` (a file cut short),
    ``corrupted`` (a byte flipped, same size), ``garbled`` (metadata that is not JSON), ``missing``
    (a file the metadata lists deleted)."""
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
    elif how == "missing":
        os.remove(os.path.join(path, files[-1]))
    elif how == "garbled":
        with open(meta_path, "w") as fh:
            fh.write('{"tensors": {')
    elif how != "good":
        raise ValueError(f"unknown damage {how!r}")


def _root() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="lab10-")


def before_save(case: dict) -> tempfile.TemporaryDirectory:
    """A root holding ``step_1``, the checkpoint before the one the save writes (another state, same layout)."""
    root = _root()
    write(state_of(dict(case, seed=case["seed"] + 100)), case["layout"], os.path.join(root.name, "step_1"))
    return root


def before_load(case: dict) -> tempfile.TemporaryDirectory:
    """A root holding ``step_5``, the case's state saved under ``case["saved"]`` (torn where the case says)."""
    root = _root()
    path = os.path.join(root.name, "step_5")
    write(state_of(case), case["saved"], path)
    if case.get("torn"):
        damage(path, "torn")
    return root


#: the modification time of a case's first directory; each next one a minute later
WRITTEN_AT = 1_700_000_000


def before_latest(case: dict) -> tempfile.TemporaryDirectory:
    """A root holding the case's directories, each saved and then damaged as the case says, in the
    case's order: each directory (and what it holds) a minute newer than the one before, so a case
    can list a smaller step after a larger one (the newest by time is not the largest step)."""
    root = _root()
    for i, (name, how) in enumerate(case["dirs"]):
        path = os.path.join(root.name, name)
        write(state_of(dict(seed=40 + i, shapes={"w": (4, 3), "b": (4,)})), {"kind": "rows", "world": 2}, path)
        damage(path, how)
        at = WRITTEN_AT + 60 * i
        for entry in os.listdir(path):
            os.utime(os.path.join(path, entry), (at, at))
        os.utime(path, (at, at))
    return root
