"""Lab 1's answers beside the kit's collectives (:func:`minidist.checks.kit.collectives.answer` runs the
student's collective on every rank): recursive halving on a world size it must refuse. The only code of
this lab's checks that calls student code."""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.checks.kit import collectives
from minidist.checks.kit.run import mark
from minidist.runtime import device
from minidist.trace import guard


def rejects(fn, case):
    """Inside a rank of a world the function must refuse: ("ValueError", message) or ("returned", None)."""
    mark(f"world_size={dist.get_world_size()}, length 8, float32")
    try:
        with guard(collectives.P2P_ONLY, "graded collectives must be built from dist.send/recv/isend/irecv only"):
            fn(torch.ones(8, device=device()))
    except ValueError as err:
        return ("ValueError", str(err))
    return ("returned", None)
