"""Plots for labs, slides and benchmarks (matplotlib). Shared file: add functions, one
section per topic; every function takes an optional ``ax`` and returns it."""
from __future__ import annotations


def _axes(ax, figsize=(8, 3)):
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=figsize)
    return ax


# ----------------------------------------------------------------------------- pipeline
PIPELINE_COLORS = {"F": "#4c72b0", "B": "#55a868", "BI": "#55a868", "BW": "#c4ad66"}


def plot_pipeline_gantt(slots, ax=None, title: str = "", p: int | None = None, unit: str = "s"):
    """Gantt chart of a pipeline timeline (``minidist.pipeline`` Slots, simulated or
    measured): one row per rank, rank 0 on top, a box per compute action labelled with
    its micro-batch (and chunk). White space is the bubble."""
    ax = _axes(ax)
    p = p or (max(s.rank for s in slots) + 1 if slots else 1)
    for s in slots:
        ax.barh(s.rank, s.end - s.start, left=s.start, height=0.8, edgecolor="black", linewidth=0.5,
                color=PIPELINE_COLORS.get(s.kind, "gray"), alpha=0.55 + 0.15 * (s.chunk % 3))
        label = f"{s.mb}" + (f".{s.chunk}" if s.chunk else "") + ("w" if s.kind == "BW" else "")
        ax.text((s.start + s.end) / 2, s.rank, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    if title:
        ax.set_title(title)
    return ax


def plot_bubble_vs_m(rows, ax=None, title: str = "pipeline bubble vs micro-batches"):
    """Bubble fraction against m, one line per (schedule, source): ``rows`` are dicts with
    keys schedule, m, and any of theory / simulated / measured (as from
    ``minidist bench pipeline --json``)."""
    ax = _axes(ax, (6, 4))
    styles = {"theory": "-", "simulated": "o", "measured": "x"}
    for sched in sorted({r["schedule"] for r in rows}):
        mine = sorted((r for r in rows if r["schedule"] == sched), key=lambda r: r["m"])
        for key, style in styles.items():
            pts = [(r["m"], r[key]) for r in mine if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{sched} {key}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax
