"""Lab 10's verdicts: what is wrong with an answer, from the case alone (no student code runs here).

* ``save_sharded``: the checkpoint directory appears only when complete (a crash at any point of
  the save, the rename included, leaves no ``path`` at all, the error reaches the caller, the
  previous checkpoint is untouched); its metadata
  lists every tensor's shape, dtype and shards; each rank's shard is exactly the box the layout gives
  it (so the bytes per rank are the formula's: ``tensor_split`` rows or columns, a replica on rank 0
  only), bit-exact; each file's size and SHA-256 are the metadata's.
* ``load_resharded``: every rank of the new layout gets its box of every tensor, bit-exact (a copy
  changes no bit), opening only the files whose shards overlap its piece; a checkpoint without
  ``metadata.json`` is refused with a ``ValueError`` naming it.
* ``latest_checkpoint``: the newest ``step_<n>`` (by n) whose metadata parses and whose files have
  the recorded sizes and checksums; ``None`` when there is none.
"""
from __future__ import annotations

import math
import os

import torch

from minidist.checks.kit.compare import tensor_error
from minidist.checks.lab10_checkpointing.helpers import box
from minidist.checks.lab10_checkpointing.cases import describe, state_of

EXACT = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 0.0}


def _owns(layout: dict, rank: int) -> bool:
    """Whether ``rank`` writes its piece (a replicated tensor: rank 0 only)."""
    return layout["kind"] != "replicated" or rank == 0


def _piece(full: torch.Tensor, offsets, lengths) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def _exact(what, got, want):
    return tensor_error(what, got, want, tol=EXACT, against="the saved tensor")


def saved(case, answer) -> str | None:
    label = f"save_sharded ({describe(case)})"
    if not answer.get("given_unchanged", True):
        return f"{label}: changed the state it was given (a save must leave the training state as it is)"
    if not answer["previous_intact"]:
        return f"{label}: the previous checkpoint (step_1) changed: a save must not touch it"
    if "crash_at" in case or "fail" in case:
        if answer["raised"] is None:
            return f"{label}: the save failed part way, but save_sharded returned as if it had saved"
        if "saved" in answer:
            return (f"{label}: after the crash the directory 'step_2' exists holding "
                    f"{answer['saved']['files']}: a torn checkpoint that a restart could load. Write everything, "
                    "metadata.json last, into a temporary directory and rename it to path only then")
        return None
    if answer["raised"] is not None:
        return f"{label}: raised {answer['raised']['type']}: {answer['raised']['message']}"
    if "saved" not in answer:
        return f"{label}: no directory at path after the save (the root holds {answer['entries']})"
    left = [e for e in answer["entries"] if e not in ("step_1", "step_2")]
    if left:
        return f"{label}: left {left} next to the checkpoint (rename the temporary directory, don't copy it)"
    saved = answer["saved"]
    if "metadata_error" in saved:
        return f"{label}: metadata.json could not be read: {saved['metadata_error']['message']}"
    return _check_saved(label, case, saved)


def _check_saved(label, case, saved) -> str | None:
    state, layout, meta = state_of(case), case["layout"], saved["metadata"]
    tensors, files = meta.get("tensors"), meta.get("files")
    if not isinstance(tensors, dict) or not isinstance(files, dict):
        return f"{label}: metadata.json needs the two keys 'tensors' and 'files' (the lab's format)"
    if sorted(tensors) != sorted(state):
        return f"{label}: metadata lists tensors {sorted(tensors)}, the state holds {sorted(state)}"
    for f in saved["files"]:
        if f.endswith(".safetensors") and f not in files:
            return f"{label}: {f} is in the directory but not in the metadata's 'files'"
    for f, rec in files.items():
        disk = saved["on_disk"].get(f)
        if disk is None:
            return f"{label}: the metadata lists {f}, which is not in the directory"
        if not isinstance(rec, dict) or rec.get("bytes") != disk["bytes"] or rec.get("sha256") != disk["sha256"]:
            return (f"{label}: the metadata records {f} as {rec!r}, but the file has {disk['bytes']} bytes and "
                    f"SHA-256 {disk['sha256'][:12]}…: record them after writing the file")
    for name, full in state.items():
        t = tensors[name]
        if list(t.get("shape", [])) != list(full.shape) or t.get("dtype") != str(full.dtype).removeprefix("torch."):
            return (f"{label}: {name} is recorded as {t.get('dtype')} {t.get('shape')}; it is "
                    f"{str(full.dtype).removeprefix('torch.')} {list(full.shape)}")
        want = {r: box(full.shape, layout, r) for r in range(layout["world"])
                if _owns(layout, r) and all(box(full.shape, layout, r)[1])}
        shards = t.get("shards", [])
        got = {}
        for i, s in enumerate(shards):
            r = s.get("rank")
            if r in got:
                return f"{label}: {name} has two shards from rank {r}"
            got[r] = (list(s.get("offsets", [])), list(s.get("lengths", [])), i, s.get("file"))
        held = sum(math.prod(v[1]) for v in got.values())
        if held != full.numel():
            return (f"{label}: the shards of {name} hold {held} elements of its {full.numel()} "
                    f"({'some written by two ranks: a replica is written by rank 0 only' if held > full.numel() else 'some by no rank'})")
        if sorted(got) != sorted(want):
            return f"{label}: {name} has shards from ranks {sorted(got)}; under this layout ranks {sorted(want)} own a piece"
        for r, (off, ln, i, file) in got.items():
            if [off, ln] != [list(x) for x in want[r]]:
                return (f"{label}: rank {r}'s shard of {name} is at offsets {off} with lengths {ln}; the layout gives "
                        f"it offsets {want[r][0]}, lengths {want[r][1]}")
            if file != f"rank{r}.safetensors":
                return f"{label}: rank {r}'s shard of {name} is in {file!r}; each rank writes rank<r>.safetensors"
            read = saved["read"].get(f"{name}#{i}", {})
            if "error" in read:
                return f"{label}: {name} of rank {r}: {read['error']}"
            if problem := _exact(f"rank {r}'s shard of {name}", read["tensor"], _piece(full, *want[r])):
                return f"{label}: {problem}"
    return None


def loaded(case, answer) -> str | None:
    label = f"load_resharded ({describe(case)})"
    if case.get("torn"):
        raised = answer["raised"]
        if raised is None:
            return f"{label}: returned from a checkpoint without metadata.json; refuse a torn checkpoint with an error"
        if raised["type"] != "ValueError" or "metadata.json" not in raised["message"]:
            return (f"{label}: raised {raised['type']}: {raised['message'][:120]!r}; refuse a torn checkpoint with a "
                    "ValueError that names the missing file, metadata.json")
        return None
    if "not plain" in answer:
        return f"{label}: rank {answer['rank']} returned {answer['not plain']}; return a dict name -> tensor"
    for r, devices in enumerate(answer["devices"]):    # host memory, whatever torch's default device is
        elsewhere = {name: d for name, d in devices.items() if d != "cpu"}
        if elsewhere:
            name, d = sorted(elsewhere.items())[0]
            return (f"{label}: rank {r}'s {name} is on {d}, not the CPU: a loaded piece belongs in host memory, "
                    "whatever torch's default device is")
    state, layout = state_of(case), case["load"]
    for r, got in enumerate(answer["pieces"]):
        if sorted(got) != sorted(state):
            return f"{label}: rank {r} got tensors {sorted(got)}; the checkpoint holds {sorted(state)}"
        for name, full in state.items():
            want = _piece(full, *box(full.shape, layout, r))
            if problem := _exact(f"rank {r}'s {name}", got[name], want):
                return f"{label}: {problem}{_saved_piece(got[name], full, case['saved'], r)}"
    for r, opened in enumerate(answer["opened"]):      # right pieces, but read from files it needs?
        extra = sorted(set(opened) - _needed(state, case["saved"], layout, r) - {"metadata.json"})
        if extra:
            return (f"{label}: rank {r} opened {extra}, which hold nothing of its piece: open a shard's file only "
                    "when its box overlaps yours (hi > lo in every dimension)")
    return None


def _needed(state: dict, saved: dict, layout: dict, r: int) -> set:
    """The files of a checkpoint saved under ``saved`` that hold part of rank r's piece under ``layout``."""
    need = set()
    for full in state.values():
        off, ln = box(full.shape, layout, r)
        for s in range(saved["world"]):
            soff, sln = box(full.shape, saved, s)
            if _owns(saved, s) and all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(off, ln, soff, sln)):
                need.add(f"rank{s}.safetensors")
    return need


def _saved_piece(got, full, saved: dict, r: int) -> str:
    """"; likely cause: ..." when rank r returned its piece of the layout the checkpoint was SAVED in."""
    old = _piece(full, *box(full.shape, saved, r)) if r < saved["world"] else None
    if isinstance(got, torch.Tensor) and old is not None and got.shape == old.shape and torch.equal(got, old):
        return (f"; likely cause: it is rank {r}'s piece of the layout the checkpoint was saved in ({saved['kind']} on "
                f"{saved['world']} ranks): a load reads the boxes that overlap the NEW layout's piece and copies "
                f"their overlap, whatever layout wrote them")
    return ""


def chosen(case, answer) -> str | None:
    label = f"latest_checkpoint ({describe(case)})"
    if "returned_type" in answer:
        return f"{label}: returned a {answer['returned_type']}; return the checkpoint's path (a str) or None"
    got, want = answer["returned"], case["want"]
    if got is not None and not answer.get("inside_root"):
        if isinstance(got, str) and os.sep not in got and got in dict(case["dirs"]):     # a name, not a path
            return (f"{label}: returned the bare name {got!r}, not a path: return the directory's path, "
                    f"os.path.join(root, {got!r})")
        return f"{label}: returned {got!r}, which is not a directory of the root"
    if got != want:
        why = dict(case["dirs"]).get(got)
        more = f" ({got} is {why})" if why and why != "good" else ""
        return f"{label}: returned {got!r}{more}; the newest good checkpoint is {want!r}"
    return None
