"""Cost of pipeline parallelism: the bubble and the activations a schedule keeps alive.

GPipe (Huang et al. 2019), 1F1B and interleaved 1F1B (Narayanan et al. 2021), ZB-H1
(Qi et al. 2023); formulas below, reproduced exactly by ``minidist.pipeline``'s simulator.
"""
from __future__ import annotations

# Share of wall time a pipeline rank sits idle ("bubble fraction") for p stages, m
# micro-batches, per-micro-batch stage times t_F, t_B. GPipe (Huang et al. 2019) and
# 1F1B (Narayanan et al. 2021) idle (p-1)(t_F + t_B) per rank out of (m+p-1)(t_F + t_B):
#     bubble = (p-1) / (m + p - 1)                       (any t_F, t_B)
# Interleaved 1F1B with v chunks per rank (Narayanan et al. 2021, sec. 2.2) fills and
# drains v times faster, chunks costing t/v:  bubble = (p-1) / (v·m + p - 1).
# ZB-H1 (Qi et al. 2023, sec. 3.1) splits t_B = t_BI + t_BW and fills the drain with
# weight gradients: idle (p-1)(t_F + t_BI - t_BW) out of m(t_F + t_B) + that, for m >= p.
# Papers often quote the bubble relative to compute instead, (p-1)/m: see
# ``pipeline_bubble_ratio``. minidist.pipeline's simulator reproduces these exactly.
PIPELINE_SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


def pipeline_bubble(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
                    t_bw: float | None = None) -> float:
    """Theoretical bubble fraction (idle share of wall time) of a pipeline schedule."""
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 and m >= 1, got p={p}, m={m}")
    if schedule == "naive":
        m = 1
    if schedule in ("naive", "gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        if m < p:
            raise ValueError(f"the ZB-H1 formula assumes m >= p (enough weight gradients to fill the "
                             f"drain); got m={m}, p={p}")
        t_bw = t_b / 2 if t_bw is None else t_bw
        idle = (p - 1) * (t_f + (t_b - t_bw) - t_bw)
        return idle / (m * (t_f + t_b) + idle)
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(PIPELINE_SCHEDULES)}")


def pipeline_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time, (p-1)/(v·m): the form in the Megatron paper."""
    return (p - 1) / (v * m)


def pipeline_peak_activations(schedule: str, p: int, m: int, rank: int = 0, v: int = 1) -> int:
    """Micro-batch activations (per chunk) a rank holds at its peak: GPipe m, 1F1B
    min(p - rank, m), ZB-H1 min(p, m) on every rank, interleaved its warmup + 1."""
    if schedule in ("naive", "gpipe"):
        return 1 if schedule == "naive" else m
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule == "zb-h1":
        return min(p, m)
    if schedule == "interleaved":
        return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(PIPELINE_SCHEDULES)}")
