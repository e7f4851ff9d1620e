"""Lab 1's answers: what the student's collective did on every rank (the only code of this lab's
checks that calls student code; the collectives' own runner is the kit's)."""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from minidist.checks.kit import collectives
from minidist.checks.kit.run import mark
from minidist.checks.lab1_collectives.cases import GRADED
from minidist.runtime import device
from minidist.trace import guard

#: per graded function: a rank's (result, trace, input unchanged) on every case of a launch
COLLECTIVE = {name: partial(collectives.answer, kind=kind) for name, (kind, _, _) in GRADED.items()}


def rejects(fn, world_size: int):
    """Inside a rank of a world the function must refuse: ("ValueError", message) or ("returned", None)."""
    mark(f"world_size={dist.get_world_size()}, length 8, float32")
    try:
        with guard(collectives.P2P_ONLY, "graded collectives must be built from dist.send/recv/isend/irecv only"):
            fn(torch.ones(8, device=device()))
    except ValueError as err:
        return ("ValueError", str(err))
    return ("returned", None)
