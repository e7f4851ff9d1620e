"""Lab 10's cases: states drawn from seeds, the layouts they are saved and loaded under, the
checkpoint directories (good, torn, truncated, corrupted) the restart logic must choose among, and
what a passing test's ✓ line says it covered. Everything runs in this process, on the CPU (files
hold CPU tensors; where a training rank's tensors live is the lab text's business)."""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import seeded

GRADED = ("save_sharded", "load_resharded", "latest_checkpoint")

#: the model states a case saves: name -> shape (a weight, a bias, Adam's moments of the weight)
SMALL = {"fc.weight": (8, 6), "fc.bias": (8,), "optim.fc.weight.exp_avg": (8, 6)}
UNEVEN = {"emb.weight": (7, 5), "proj.weight": (5, 3), "proj.bias": (5,), "step": (1,)}


def lay(kind: str, world: int) -> dict:
    return {"kind": kind, "world": world}


def state_of(case: dict) -> dict[str, torch.Tensor]:
    dtype = case.get("dtype", torch.float32)
    return {name: seeded(shape, case["seed"] + i, dtype) for i, (name, shape) in enumerate(case["shapes"].items())}


def save_cases(hidden: bool) -> list[dict]:
    cases = [dict(seed=1, shapes=SMALL, layout=lay("rows", 2)),
             dict(seed=2, shapes=SMALL, layout=lay("replicated", 4)),
             dict(seed=3, shapes=SMALL, layout=lay("cols", 2), crash_at=2)]
    if hidden:
        cases += [dict(seed=4, shapes=UNEVEN, layout=lay("rows", 4)),          # 7 and 5 rows over 4 ranks
                  dict(seed=5, shapes=UNEVEN, layout=lay("cols", 3)),
                  dict(seed=6, shapes=UNEVEN, layout=lay("rows", 4), dtype=torch.float64, crash_at=3),
                  dict(seed=7, shapes={"w": (3, 2)}, layout=lay("rows", 4))]       # rank 3 holds nothing
    return cases


def load_cases(hidden: bool) -> list[dict]:
    cases = [dict(seed=11, shapes=SMALL, saved=lay("rows", 4), load=lay("rows", 2)),       # 4 ranks -> 2
             dict(seed=12, shapes=SMALL, saved=lay("rows", 2), load=lay("cols", 2)),       # rows -> columns
             dict(seed=13, shapes=SMALL, saved=lay("rows", 2), load=lay("rows", 2), torn=True)]
    if hidden:
        cases += [dict(seed=14, shapes=UNEVEN, saved=lay("replicated", 2), load=lay("cols", 3)),
                  dict(seed=15, shapes=UNEVEN, saved=lay("cols", 3), load=lay("replicated", 2)),
                  dict(seed=16, shapes=UNEVEN, saved=lay("rows", 4), load=lay("cols", 4), dtype=torch.float64),
                  dict(seed=17, shapes=UNEVEN, saved=lay("cols", 2), load=lay("rows", 3), torn=True)]
    return cases


def latest_cases(hidden: bool) -> list[dict]:
    """Directories under a root, each (name, what happened to it), and the one a restart must use."""
    cases = [dict(dirs=[("step_2", "good"), ("step_4", "good"), ("step_6", "torn")], want="step_4"),
             dict(dirs=[("step_9", "good"), ("step_10", "good")], want="step_10"),
             dict(dirs=[("step_3", "good"), ("step_5", "truncated")], want="step_3")]
    if hidden:
        cases += [dict(dirs=[("step_1", "good"), ("step_2", "corrupted")], want="step_1"),
                  dict(dirs=[("step_7", "torn"), ("step_8", "garbled")], want=None),
                  dict(dirs=[], want=None),
                  dict(dirs=[("step_98", "good"), ("step_99", "truncated"), ("step_100", "torn"),
                             ("step_101.tmp", "good")], want="step_98")]
    return cases


def describe(case: dict) -> str:
    d = lambda l: f"{l['kind']} on {l['world']}"      # noqa: E731
    if "layout" in case:
        return f"{d(case['layout'])} ranks" + (f", a crash at the tensor #{case['crash_at']}" if "crash_at" in case else "")
    if "saved" in case:
        return f"saved {d(case['saved'])}, loaded {d(case['load'])}" + (" (metadata.json missing)" if case.get("torn") else "")
    return ", ".join(f"{n} {h}" for n, h in case["dirs"]) or "an empty root"


def save_covered(hidden: bool) -> str:
    return "; ".join(describe(c) for c in save_cases(hidden))


def load_covered(hidden: bool) -> str:
    return "; ".join(describe(c) for c in load_cases(hidden))


def latest_covered(hidden: bool) -> str:
    return "; ".join(f"[{describe(c)}] -> {c['want']}" for c in latest_cases(hidden))
