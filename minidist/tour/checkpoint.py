"""``minidist tour`` rows for distributed checkpointing (:mod:`minidist.checkpoint`).

* **reshard**: ZeRO-3 on 4 ranks trains 4 steps of TinyMLP with Adam, saving at steps 2 and 4; its
  step-2 checkpoint is resumed under DDP on 2 ranks to step 4. max_err: the largest relative
  error over every tensor (weights, both Adam moments) against the uninterrupted run; bytes:
  what the busiest rank wrote (its shard of each FSDP unit's padded flat buffer, three times:
  weights and two moments, plus the step on rank 0) next to
  :func:`minidist.cost.checkpoint.flat_shard_elements`; ``passed`` also needs every rank's bytes to match.
* **async save**: a wider ZeRO-3 TinyMLP (about 1.6 M parameters) on 2 ranks, saving once
  blocking and once asynchronously; the note gives the step time of the saving step both ways.
  max_err: the two checkpoints against each other (the same training, so 0).
* **restart**: ZeRO-3 on 4 ranks, rank 1 killed in the middle of the step-4 save (its file written,
  its record not), ``launch(max_restarts=1)`` restarts, the job resumes from step 2. max_err: the
  final weights and moments against the uninterrupted run (bit-identical expected).
* **restart, fp16 with noise**: DDP with fp16 mixed precision and a dynamic loss scale on 2 ranks,
  Gaussian noise drawn from each rank's generator; rank 1 dies mid-step at step 4 and the job
  resumes from step 2. max_err: the final weights, masters and moments against the uninterrupted
  run; ``passed`` also needs the loss scaler's state and the data position (the metadata's
  ``extra``) equal: what the random states and the scaler's state saved beside the tensors buy.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from minidist.checkpoint import read_metadata
from minidist.cost.checkpoint import flat_shard_elements
from minidist.harness import checkpoint as harness
from minidist.models import TinyMLP
from minidist.runtime import launch, timed
from minidist.tour import TourEntry

P, STEPS, EVERY = 4, 4, 2
WIDE = 512          # the async row's TinyMLP width: about 1.6 M parameters, 19 MB of model states
ZERO3 = ("zero", 3)
FP16, NOISE = ("ddp", "fp16"), 0.05


def _err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).double().norm() / b[k].double().norm().clamp(min=1e-30)) for k in b)


def _written(path: str) -> dict[int, int]:
    from minidist.checkpoint import verify
    meta, out = verify(path), {}
    for key, t in meta["tensors"].items():
        if key.startswith("rng."):          # each rank's random states: a few KB, not model states
            continue
        for s in t["shards"]:
            n = 1
            for x in s["lengths"]:
                n *= x
            out[s["rank"]] = out.get(s["rank"], 0) + 4 * n      # every tensor here is fp32
    return out


def _uninterrupted(root: str) -> str:
    launch(harness.train, P, ZERO3, root, STEPS, every=EVERY, timeout=120)
    return os.path.join(root, f"step_{STEPS:08d}")


def _reshard(tmp: str) -> dict:
    full = _uninterrupted(os.path.join(tmp, "full"))
    resumed = os.path.join(tmp, "resumed")
    shutil.copytree(os.path.join(tmp, "full", f"step_{EVERY:08d}"), os.path.join(resumed, f"step_{EVERY:08d}"))
    launch(harness.train, 2, ("ddp",), resumed, STEPS, every=EVERY, timeout=120)
    err = _err(harness.full_state(os.path.join(resumed, f"step_{STEPS:08d}"), ("ddp",)), harness.full_state(full, ZERO3))
    model = TinyMLP(**harness.MLP_DIMS, device="cpu")
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    theory = {r: 4 * (3 * sum(flat_shard_elements(u, P, r) for u in units) + (r == 0)) for r in range(P)}
    got = _written(full)
    busiest = max(theory, key=theory.get)
    return {"max_err": err, "bytes_per_rank": got.get(busiest, 0), "bytes_theory": theory[busiest],
            "passed": got == theory and err <= 1e-6, "tolerance": 1e-6,     # a NaN error fails too
            "note": "ZeRO-3 x 4 ranks saved at step 2, resumed as DDP x 2 to step 4, vs the uninterrupted run"}


def _async(tmp: str) -> dict:
    times, paths = {}, {}
    for blocking in (True, False):
        root = os.path.join(tmp, "blocking" if blocking else "async")
        out = launch(harness.save_stall, 2, root, blocking, WIDE, timeout=300)
        times[blocking] = max(o["step_s"][1] for o in out)
        paths[blocking] = os.path.join(root, "step_00000001")
    dims = harness.stall_dims(WIDE)
    err = _err(harness.full_state(paths[False], ZERO3, dims), harness.full_state(paths[True], ZERO3, dims))
    written = _written(paths[False])
    return {"max_err": err, "bytes_per_rank": max(written.values()), "bytes_theory": None, "tolerance": 0.0,
            "blocking_step_s": times[True], "async_step_s": times[False],
            "note": f"saving step: blocking {times[True] * 1e3:.0f} ms, async {times[False] * 1e3:.0f} ms "
                    "(host copy only; the writer thread shares the CPU with training)"}


def _restart(tmp: str) -> dict:
    full = _uninterrupted(os.path.join(tmp, "full"))
    root, marker = os.path.join(tmp, "crash"), os.path.join(tmp, "crash-once")
    open(marker, "w").close()
    lost = []
    out = launch(harness.train, P, ZERO3, root, STEPS, every=EVERY, crash_at=(1, 3, "save"), crash_marker=marker,
                 max_restarts=1, on_restart=lambda attempt, err: lost.append(str(err).splitlines()[0]), timeout=120)
    err = _err(harness.full_state(os.path.join(root, f"step_{STEPS:08d}"), ZERO3), harness.full_state(full, ZERO3))
    return {"max_err": err, "bytes_per_rank": None, "bytes_theory": None, "tolerance": 0.0,
            "passed": len(lost) == 1 and out[0]["start"] == EVERY and err == 0.0,      # bit-identical (NaN fails)
            "note": f"rank 1 killed mid-save at step 4 ({lost[0] if lost else 'no failure'}); restarted from "
                    f"step {out[0]['start']}, {STEPS - out[0]['start']} steps redone"}


def _restart_fp16(tmp: str) -> dict:
    full, root, marker = os.path.join(tmp, "full"), os.path.join(tmp, "crash"), os.path.join(tmp, "crash-once")
    launch(harness.train, 2, FP16, full, STEPS, every=EVERY, noise=NOISE, timeout=120)
    open(marker, "w").close()
    lost = []
    out = launch(harness.train, 2, FP16, root, STEPS, every=EVERY, noise=NOISE, crash_at=(1, 3, "step"),
                 crash_marker=marker, max_restarts=1, on_restart=lambda attempt, err: lost.append(str(err)),
                 timeout=120)
    last = f"step_{STEPS:08d}"
    err = _err(harness.full_state(os.path.join(root, last), FP16), harness.full_state(os.path.join(full, last), FP16))
    extra = read_metadata(os.path.join(root, last))["extra"], read_metadata(os.path.join(full, last))["extra"]
    return {"max_err": err, "bytes_per_rank": None, "bytes_theory": None, "tolerance": 0.0,
            "passed": len(lost) == 1 and out[0]["start"] == EVERY and err == 0.0 and extra[0] == extra[1],
            "note": f"rank 1 killed mid-step at step 4; restarted from step {out[0]['start']}; loss scale "
                    f"{extra[0]['scaler']['scale']:g} and data position {extra[0]['sampler']['position']} "
                    f"{'equal' if extra[0] == extra[1] else 'DIFFERENT'} to the uninterrupted run's"}


ROWS = {"checkpoint: reshard ZeRO-3 x 4 -> DDP x 2": _reshard, "checkpoint: async vs blocking save": _async,
        "checkpoint: restart after a crash mid-save": _restart,
        "checkpoint: restart of fp16 with noise mid-step": _restart_fp16}
WORLD = {"checkpoint: restart of fp16 with noise mid-step": 2}      # the others: P


def tour_row(label: str) -> dict:
    with timed() as clock, tempfile.TemporaryDirectory(prefix="minidist-tour-ckpt-") as tmp:
        row = ROWS[label](tmp)
    return {"technique": label, "world_size": WORLD.get(label, P)} | row | {"time_s": clock.seconds}


def tour_entries() -> list[TourEntry]:
    return [TourEntry(label, WORLD.get(label, P), lambda k=label: tour_row(k)) for label in ROWS]
