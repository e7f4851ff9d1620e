"""The toy lab's ``allsum(x)``: an all-reduce on 2 ranks, with ``dist.all_reduce`` allowed besides
point-to-point. Its answer and verdict are the kit's collectives' (:mod:`minidist.checks.kit.collectives`);
the hidden lengths and dtypes are the grader's, in ``hidden.py``."""
from __future__ import annotations

import torch

from minidist.checks.kit.collectives import P2P_ONLY, collective_cases
from minidist.checks.kit.withheld import hidden_cases

ALLOWED = P2P_ONLY | {"all_reduce"}       # the toy lab may use dist.all_reduce


def cases(hidden: bool) -> list:
    """One launch of 2 ranks: length 3 in fp32, or the hidden lengths and dtypes."""
    h = hidden_cases(__package__, "allsum") if hidden else None
    lengths, dtypes = (h.ALLSUM_LENGTHS, h.ALLSUM_DTYPES) if hidden else ((3,), (torch.float32,))
    return collective_cases("all_reduce", (2,), lengths, dtypes, name="allsum", allow=ALLOWED)


def covered(hidden: bool) -> str:
    shown = hidden_cases(__package__, "allsum").ALLSUM_SHOWN if hidden else "length 3 in fp32"
    return "2 ranks, " + shown + ": the sum on every rank"
