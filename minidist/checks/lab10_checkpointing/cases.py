"""Lab 10's cases: states drawn from seeds, the layouts they are saved and loaded under, the
checkpoint directories (good, torn, truncated, corrupted) the restart logic must choose among, and
what a passing test's ✓ line says it covered. Everything runs in this process, on the CPU (files
hold CPU tensors; where a training rank's tensors live is the lab text's business). The hidden cases
are the grader's, in ``hidden.py``."""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import seeded
from minidist.checks.kit.withheld import hidden_cases

#: every graded function of the lab (its test cell is test_<name>); the last four have their cases in modules of their own
GRADED = ("save_sharded", "load_resharded", "latest_checkpoint", "checkpoint_interval", "goodput", "async_saver",
          "train_resumable")

#: the model states a case saves: name -> shape (a weight, a bias, Adam's moments of the weight)
SMALL = {"fc.weight": (8, 6), "fc.bias": (8,), "optim.fc.weight.exp_avg": (8, 6)}
UNEVEN = {"emb.weight": (7, 5), "proj.weight": (5, 3), "proj.bias": (5,), "step": (1,)}


def lay(kind: str, world: int) -> dict:
    return {"kind": kind, "world": world}


def state_of(case: dict) -> dict[str, torch.Tensor]:
    dtype = case.get("dtype", torch.float32)
    return {name: seeded(shape, case["seed"] + i, dtype) for i, (name, shape) in enumerate(case["shapes"].items())}


#: where a crash case's save fails (``fail``; ``crash_at``: reading the k-th tensor of the state)
FAILS = {"metadata": "the disk full while writing metadata.json", "rename": "the rename failing"}


def save_cases(hidden: bool) -> list[dict]:
    cases = [dict(seed=1, shapes=SMALL, layout=lay("rows", 2)),
             dict(seed=2, shapes=SMALL, layout=lay("replicated", 4)),
             dict(seed=3, shapes=SMALL, layout=lay("cols", 2), dtype=torch.float64),
             dict(seed=8, shapes=SMALL, layout=lay("rows", 2), crash_at=2),
             dict(seed=9, shapes=SMALL, layout=lay("rows", 2), fail="metadata"),
             dict(seed=10, shapes=SMALL, layout=lay("cols", 2), fail="rename")]
    if hidden:
        cases += hidden_cases(__package__, "save_sharded").SAVE
    return cases


def load_cases(hidden: bool) -> list[dict]:
    cases = [dict(seed=11, shapes=SMALL, saved=lay("rows", 4), load=lay("rows", 2)),       # 4 ranks -> 2
             dict(seed=12, shapes=SMALL, saved=lay("rows", 2), load=lay("cols", 2)),       # rows -> columns
             dict(seed=18, shapes=SMALL, saved=lay("cols", 2), load=lay("rows", 4), dtype=torch.bfloat16),
             dict(seed=13, shapes=SMALL, saved=lay("rows", 2), load=lay("rows", 2), torn=True)]
    if hidden:
        cases += hidden_cases(__package__, "load_resharded").LOAD
    return cases


def latest_cases(hidden: bool) -> list[dict]:
    """Directories under a root, each (name, what happened to it), written in the listed order (each a
    minute after the one before), and the one a restart must use."""
    cases = [dict(dirs=[("step_2", "good"), ("step_4", "good"), ("step_6", "torn")], want="step_4"),
             dict(dirs=[("step_10", "good"), ("step_9", "good")], want="step_10"),        # step_9 written later
             dict(dirs=[("step_3", "good"), ("step_5", "truncated")], want="step_3"),
             dict(dirs=[("step_1", "good"), ("step_2", "corrupted"), ("step_3.tmp", "good")], want="step_1"),
             dict(dirs=[("step_5", "good"), ("step_6", "missing")], want="step_5")]
    if hidden:
        cases += hidden_cases(__package__, "latest_checkpoint").LATEST
    return cases


def describe(case: dict) -> str:
    d = lambda l: f"{l['kind']} on {l['world']}"      # noqa: E731
    if "layout" in case:
        dtype = f", {str(case['dtype']).removeprefix('torch.')}" if "dtype" in case else ""
        crash = (f", a crash at the tensor #{case['crash_at']}" if "crash_at" in case else
                 f", {FAILS.get(case['fail']) or 'the disk full while writing file #%d' % case['fail'][1]}"
                 if "fail" in case else "")
        return f"{d(case['layout'])} ranks{dtype}{crash}"
    if "saved" in case:
        dtype = f", {str(case['dtype']).removeprefix('torch.')}" if "dtype" in case else ""
        return (f"saved {d(case['saved'])}, loaded {d(case['load'])}{dtype}"
                + (" (metadata.json missing)" if case.get("torn") else ""))
    return ", ".join(f"{n} {h}" for n, h in case["dirs"]) or "an empty root"


def save_covered(hidden: bool) -> str:
    return "; ".join(describe(c) for c in save_cases(hidden))


def load_covered(hidden: bool) -> str:
    return "; ".join(describe(c) for c in load_cases(hidden))


def latest_covered(hidden: bool) -> str:
    return "; ".join(f"[{describe(c)}] -> {c['want']}" for c in latest_cases(hidden))
