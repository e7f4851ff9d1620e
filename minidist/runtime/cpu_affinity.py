"""Where a rank's threads run when a launch has more ranks than the machine has cores.

A lab machine of 2 cores runs launches of 3, 4 and 5 ranks. Left to the scheduler, each rank's
threads (its Python thread, gloo's worker and its transport's event loop) wander between the
cores, and every message that wakes a thread on the other core costs a cross-core wake-up: on a
virtual machine that is most of what a small collective costs. Measured on 2 cores (gloo, 200
all-reduces of 4 KB, CPU of all ranks): 4 ranks 1.68 -> 0.78 core-s, 5 ranks 2.51 -> 1.16, 3 ranks
0.80 -> 0.63; 2 ranks and compute (matmuls) unchanged. So when ranks outnumber the cores, rank
``r`` keeps all its threads on one core, ``cores[(r + offset) % C]``: the cores share the ranks
evenly, and ``offset`` (one per launch) keeps two launches side by side from crowding the same
core. With as many cores as ranks, or more, nothing is pinned: a rank may use every core it sees.
"""
from __future__ import annotations

import os


def allowed_cores() -> list[int]:
    """The cores this process may run on (a container's or ``taskset``'s limit, not the machine's)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # no affinity on this platform: nothing to pin to
        return []


def core_for_rank(rank: int, world_size: int, offset: int = 0, cores: list[int] | None = None) -> int | None:
    """The one core rank ``rank`` of ``world_size`` keeps its threads on, or None (not oversubscribed)."""
    cores = allowed_cores() if cores is None else cores
    if not cores or world_size <= len(cores):
        return None
    return cores[(rank + offset) % len(cores)]


def pin_when_oversubscribed(rank: int, world_size: int, offset: int = 0) -> int | None:
    """Pin every thread of this process to :func:`core_for_rank`'s core; threads started later
    (gloo's, when the group is made) inherit it. Returns the core, or None when nothing was pinned."""
    core = core_for_rank(rank, world_size, offset)
    if core is None:
        return None
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), {core})
        except OSError:             # a thread that ended meanwhile
            pass
    return core
