"""What a checkpoint costs, and how often to take one: Young 1974, Daly 2006.

**Size.** A checkpoint holds the model states: per parameter the fp32 weight and, with Adam,
its two moments (12 bytes; 14 with the bf16 weights next to the fp32 master copy), plus a few numbers
(the step, the data position, the loss scale). Ψ parameters on a DP × PP × TP layout:

* TP and PP cut every tensor into t·p disjoint pieces: each (pp, tp) position owns Ψ/(t·p);
* a DP replica is written once: without ZeRO, DP rank 0 writes its piece and the other d − 1
  write nothing; with ZeRO (any stage: the optimizer states are sharded, and the parameters
  are written from the same flat slices) each DP rank writes ⌈Ψ/(t·p·d)⌉ of each flat buffer.

**Time.** C = (total bytes) / (storage bandwidth), but never less than the busiest rank's bytes
over one rank's own bandwidth: a replicated layout funnels everything through d times fewer
writers, so it is slower than its size suggests.

**How often.** A job fails when any of its N GPUs does: with independent failures at a constant
rate, the job's MTBF is the per-GPU one divided by N (M = M_gpu / N). With a mean time between
failures M and a checkpoint costing C, saving every τ seconds of work wastes C/τ on saving and,
on average, (τ + C)/2 of work per failure (redone from the last checkpoint), plus R to restart. Minimising C/τ + τ/(2M) gives
Young's interval (J. W. Young, "A first order approximation to the optimum checkpoint
interval", CACM 1974):

    τ_opt = √(2·C·M)

and Daly's higher-order refinement (J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 2006), for C < 2M:

    τ_opt = √(2·C·M) · (1 + ⅓·√(C/(2M)) + (1/9)·C/(2M)) − C.

Goodput, the share of wall time that moves training forward, is then about
1 − C/τ − (τ + C)/(2M) − R/M. An asynchronous save only blocks training for the copy to host
memory, so its C in the first term is that copy's time (the write still decides how soon the
next save can start).

Llama 3 (Dubey et al. 2024, Sec. 3.3.4): 419 unexpected interruptions in 54 days on 16,384
GPUs, M ≈ 3.1 hours for the whole job.
"""
from __future__ import annotations

import math

__all__ = ["BYTES_PER_PARAM", "flat_shard_elements", "checkpoint_bytes_per_rank", "save_seconds", "job_mtbf",
           "young_interval", "daly_interval", "goodput", "LLAMA3_MTBF_S"]

# fp32 weight and Adam's two moments; mixed precision adds the bf16 weights to the fp32 master copy
BYTES_PER_PARAM = {"adam": 12, "adam-mixed": 14, "sgd": 8}
LLAMA3_MTBF_S = 54 * 24 * 3600 / 419                           # Dubey et al. 2024: about 3.1 hours


def flat_shard_elements(numel: int, world: int, rank: int) -> int:
    """Elements of a Ψ-element flat buffer, padded to N·⌈Ψ/N⌉, that rank ``rank`` holds and saves."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    shard = -(-numel // world)
    return max(0, min(shard, numel - rank * shard))


def checkpoint_bytes_per_rank(params: int, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0,
                              optimizer: str = "adam") -> list[int]:
    """Bytes each of the dp·pp·tp ranks writes (rank order (dp, pp, tp) row-major), for Ψ = ``params``
    split evenly by TP and PP. ``zero``: 0 (replicated DP) or the ZeRO stage 1–3."""
    if optimizer not in BYTES_PER_PARAM:
        raise ValueError(f"optimizer must be one of {sorted(BYTES_PER_PARAM)}, got {optimizer!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    for name, v in (("params", params), ("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    piece = params // (tp * pp)     # even split; the course's layouts need divisibility anyway
    out = []
    for i_dp in range(dp):
        elems = flat_shard_elements(piece, dp, i_dp) if zero else (piece if i_dp == 0 else 0)
        out += [elems * BYTES_PER_PARAM[optimizer]] * (pp * tp)
    return out


def save_seconds(bytes_per_rank: list[int], storage_bw: float, rank_bw: float | None = None) -> float:
    """Seconds to write a checkpoint: all bytes through the storage's ``storage_bw`` (bytes/s), and
    the busiest rank's through its own ``rank_bw`` (bytes/s; None: no per-rank limit)."""
    if storage_bw <= 0 or (rank_bw is not None and rank_bw <= 0):
        raise ValueError("bandwidths must be positive")
    t = sum(bytes_per_rank) / storage_bw
    return max(t, max(bytes_per_rank) / rank_bw) if rank_bw else t


def job_mtbf(gpu_mtbf_s: float, gpus: int) -> float:
    """The MTBF of a job on ``gpus`` GPUs, each failing independently every ``gpu_mtbf_s`` seconds on
    average: the failure rates add, so M = M_gpu / N."""
    if gpu_mtbf_s <= 0 or isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"need a per-GPU MTBF > 0 and gpus >= 1, got {gpu_mtbf_s!r} and {gpus!r}")
    return gpu_mtbf_s / gpus


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young 1974: seconds of work between checkpoints, √(2·C·M)."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("need a checkpoint cost >= 0 and an MTBF > 0")
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly 2006's higher-order optimum (for C < 2M; M itself beyond, as Daly says)."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def goodput(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0,
            blocking_s: float | None = None) -> float:
    """Share of wall time spent on work that is kept: 1 − B/τ − (τ + C)/(2M) − R/M, at least 0.
    ``blocking_s`` (B): what a save stalls training for; the whole C when None (a blocking save)."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError("need an interval > 0 and an MTBF > 0")
    b = cost_s if blocking_s is None else blocking_s
    return max(0.0, 1 - b / interval_s - (interval_s + cost_s) / (2 * mtbf_s) - restart_s / mtbf_s)
