"""Exposed communication: the part of a transfer that no computation hides.

One rule, applied per technique (``minidist.overlap``'s three):

    exposed = max(0, T_comm - T_overlap)

T_comm is the α-β time of the transfer (:mod:`minidist.cost.collectives`), T_overlap the
computation that can run while it travels: computation that does not need its result, at the
rank's FLOP rate. When transfers queue behind each other on one link, each waits for the one
before it (:func:`queued_exposed`).

* **DDP, bucketed** (:func:`ddp_exposed`): bucket k of K is ready at (k+1)/K of backward; its
  all-reduce starts then or when the previous one ends. Exposed: what runs past the end of
  backward. Plain (all launched after backward): every all-reduce.
* **FSDP prefetch** (:func:`prefetch_exposed`): unit i's all-gather overlaps unit i-1's compute;
  the first one is exposed. Plain: every all-gather. Memory: two neighbouring units gathered
  at once instead of one (:func:`prefetch_extra_bytes`).
* **Collective matmul as a ring** (:func:`ring_exposed`, :func:`collective_matmul`): t-1 message
  steps, each overlapping one chunk's matmul: (t-1)·max(0, α + Sβ - T_chunk). Plain: the whole
  collective, (t-1)(α + Sβ) for a ring all-gather, exposed.

The planner (:mod:`minidist.cost.planner`) counts the DP and the TP overlap in its step time:
:func:`dp_overlap_compute` and :func:`tp_overlap_compute` give the computation each can hide behind.
"""
from __future__ import annotations

__all__ = ["exposed_time", "queued_exposed", "ddp_exposed", "prefetch_exposed", "prefetch_extra_bytes",
           "ring_exposed", "ring_bytes", "collective_matmul", "dp_overlap_compute", "tp_overlap_compute",
           "OVERLAPS"]

OVERLAPS = ("dp", "tp")     # what the planner can count: DDP's buckets, asynchronous TP


def exposed_time(comm: float, overlappable: float) -> float:
    """max(0, comm - overlappable): seconds of ``comm`` that ``overlappable`` computation cannot hide."""
    if comm < 0 or overlappable < 0:
        raise ValueError(f"times must be >= 0, got comm={comm}, overlappable={overlappable}")
    return max(0.0, comm - overlappable)


def queued_exposed(ready: list[float], durations: list[float], end: float) -> float:
    """Transfers on one link in order: transfer i starts at max(ready[i], when i-1 ended). Seconds
    the last one ends after ``end`` (when the computation that hides them is over), 0 if before."""
    if len(ready) != len(durations):
        raise ValueError("one ready time per transfer")
    done = float("-inf")
    for r, d in zip(ready, durations):
        done = max(done, r) + d
    return max(0.0, done - end) if durations else 0.0


def ddp_exposed(bucket_comm: list[float], backward: float, overlap: bool = True) -> float:
    """Exposed all-reduce seconds of bucketed DDP: bucket k of K ready at (k+1)/K of ``backward``
    (gradients arrive at an even pace, the last bucket at the end); with ``overlap=False`` every
    all-reduce starts after backward and all of them are exposed."""
    k = len(bucket_comm)
    if not overlap:
        return float(sum(bucket_comm))
    return queued_exposed([backward * (i + 1) / k for i in range(k)], list(bucket_comm), backward)


def prefetch_exposed(gather: list[float], compute: list[float], prefetch: bool = True) -> float:
    """Exposed all-gather seconds of FSDP's units in order (gather[i], compute[i] for unit i):
    with prefetch, unit i's gather is issued when unit i-1 starts computing, so it is exposed only
    by what it takes beyond that compute (and the first one entirely); without, all of them."""
    if len(gather) != len(compute):
        raise ValueError("one compute time per unit")
    if not prefetch or not gather:
        return float(sum(gather))
    return gather[0] + sum(exposed_time(g, c) for g, c in zip(gather[1:], compute[:-1]))


def prefetch_extra_bytes(unit_bytes: list[float]) -> float:
    """Memory prefetch costs: the most full parameters gathered at once, two neighbouring units
    (max over i of b_i + b_(i+1)), minus one unit (max of b_i) without prefetch."""
    if len(unit_bytes) < 2:
        return 0.0
    return max(a + b for a, b in zip(unit_bytes, unit_bytes[1:])) - max(unit_bytes)


def ring_bytes(shard_bytes: int, t: int) -> int:
    """Bytes one rank sends (and receives) in a ring collective matmul: t-1 chunks of ``shard_bytes``."""
    if t < 1:
        raise ValueError(f"t must be >= 1, got {t}")
    return (t - 1) * shard_bytes


def ring_exposed(step_comm: float, step_compute: float, t: int, decomposed: bool = True) -> float:
    """Exposed seconds of a ring collective matmul on t ranks: t-1 message steps of ``step_comm``
    each, each hidden behind one chunk's matmul of ``step_compute``; plain, all of them."""
    if t < 1:
        raise ValueError(f"t must be >= 1, got {t}")
    return (t - 1) * (exposed_time(step_comm, step_compute) if decomposed else step_comm)


def collective_matmul(rows: int, d_in: int, d_out: int, t: int, alpha: float, beta: float, flops: float,
                      elem_bytes: int = 4, gathered: str = "input") -> dict:
    """Times of all-gather + matmul (``gathered="input"``: the input's ``rows`` are sharded over t,
    each step moves rows/t × d_in) or matmul + reduce-scatter (``"output"``: each step moves
    rows/t × d_out partial sums) on t ranks; ``d_out`` is this rank's output width, ``flops`` its
    FLOP rate. Returns per-step message and matmul seconds, and exposed seconds plain and decomposed."""
    if rows % t:
        raise ValueError(f"{rows} rows do not split over {t} ranks")
    if gathered not in ("input", "output"):
        raise ValueError(f"gathered must be 'input' or 'output', got {gathered!r}")
    chunk = rows // t
    step_comm = alpha + chunk * (d_in if gathered == "input" else d_out) * elem_bytes * beta
    step_compute = 2 * chunk * d_in * d_out / flops
    return {"step_comm_s": step_comm, "step_compute_s": step_compute, "compute_s": t * step_compute,
            "exposed_plain_s": ring_exposed(step_comm, step_compute, t, decomposed=False),
            "exposed_ring_s": ring_exposed(step_comm, step_compute, t)}


def dp_overlap_compute(compute: float, micro_batches: int) -> float:
    """Computation DDP's gradient all-reduce can hide behind: the backward (2/3 of forward +
    backward) of the last micro-batch, whose hooks launch the buckets (``no_sync`` before it)."""
    return 2 / 3 * compute / max(1, micro_batches)


def tp_overlap_compute(linear_compute: float, t: int) -> float:
    """Computation asynchronous TP can hide its collectives behind: (t-1)/t of the linear layers'
    matmuls next to them (the first chunk's, or the last, has no message beside it)."""
    return linear_compute * (t - 1) / t if t > 1 else 0.0
