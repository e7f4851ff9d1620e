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
    """Bubble fraction against m, one colour per schedule and a style per source: ``rows`` are dicts with
    keys schedule, m, and any of theory / simulated / measured (as from
    ``minidist bench pipeline --json``)."""
    ax = _axes(ax, (6, 4))
    # schedules after the first are dashed, hollow and larger: equal bubbles (GPipe's and 1F1B's) must not hide
    first = {"theory": ("-", {}), "simulated": ("o", {}), "measured": ("x", {})}
    later = {"theory": ("--", {}), "simulated": ("o", {"markerfacecolor": "none", "markersize": 10}),
             "measured": ("+", {"markersize": 11})}
    for i, sched in enumerate(sorted({r["schedule"] for r in rows})):
        mine = sorted((r for r in rows if r["schedule"] == sched), key=lambda r: r["m"])
        for key, (style, extra) in (later if i else first).items():
            pts = [(r["m"], r[key]) for r in mine if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{sched} {key}", **extra)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax


# -------------------------------------------------------------------------- collectives
def plot_busbw(rows: list[dict], path: str | None = None, title: str | None = None):
    """busbw vs message size, one colour per algorithm: measurements as markers, the fitted
    α-β model (``model_us`` column of ``minidist bench collectives``) as a dashed line.

    The model line is what the fitted α, β predict for that algorithm at every size;
    where a marker sits far from its line, the α-β(-γ) model misses something (contention
    on a shared CPU, copies, Python overhead per message).
    """
    import matplotlib
    if path:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    from minidist import cost

    fig, ax = plt.subplots(figsize=(7, 4.5))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    n = rows[0]["world_size"] if rows else 1
    for i, alg in enumerate(algorithms):
        pts = sorted((r for r in rows if r["algorithm"] == alg), key=lambda r: r["bytes"])
        color = f"C{i % 10}"
        ax.plot([r["bytes"] for r in pts], [r["busbw_GBps"] for r in pts], "o-" if alg == "native" else "o",
                color=color, label=alg)
        fitted = [r for r in pts if "alpha_us" in r]
        if fitted:
            alpha, beta = fitted[0]["alpha_us"] * 1e-6, 1e-9 / fitted[0]["beta_GBps"]
            S = np.geomspace(pts[0]["bytes"], pts[-1]["bytes"], 60)
            T = np.array([cost.allreduce_time(fitted[0].get("model", alg), n, s, alpha, beta) for s in S])
            ax.plot(S, cost.busbw(S, T, n) / 1e9, "--", color=color, alpha=0.7)
    fit = next((r for r in rows if "alpha_us" in r), None)
    note = f"dashed: α-β fit, α = {fit['alpha_us']:.0f} µs, 1/β = {fit['beta_GBps']:.2f} GB/s" if fit else ""
    ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="busbw (GB/s)",
           title=title or f"all-reduce on {n} ranks\n{note}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


# ------------------------------------------------------------------------- communication
COMM_COLORS = {"send": "#dd8452", "isend": "#dd8452", "recv": "#4c72b0", "irecv": "#4c72b0"}


def plot_comm_timeline(trace, ax=None, title: str = "communication timeline", arrows: bool = True):
    """Per-rank timeline of a merged :class:`minidist.trace.Trace`: a bar per operation
    (sends orange, receives blue, collectives grey, spans green) and, for point-to-point
    traffic, an arrow from each send to the matching receive."""
    ax = _axes(ax, (9, 0.6 + 0.55 * max(1, len(trace.ranks()))))
    events = [e for e in trace.events if not e.op.startswith("api:")]
    if not events:
        ax.set_title(f"{title} (no events)")
        return ax
    t0 = min(e.start for e in events)
    ms = lambda t: (t - t0) * 1e3
    for e in events:
        color = "#55a868" if e.op.startswith("span:") else COMM_COLORS.get(e.op, "#8c8c8c")
        ax.barh(e.rank, max(ms(e.end) - ms(e.start), 1e-3), left=ms(e.start), height=0.6,
                color=color, edgecolor="black", linewidth=0.3)
    if arrows:
        # Match the k-th send r->p with the k-th receive at p from r: messages of a pair arrive in order.
        pending: dict = {}
        for e in sorted((e for e in events if e.is_recv), key=lambda e: e.start):
            pending.setdefault((e.peer, e.rank), []).append(e)
        for s in sorted((e for e in events if e.is_send), key=lambda e: e.start):
            queue = pending.get((s.rank, s.peer))
            if queue:
                r = queue.pop(0)
                ax.annotate("", xy=(ms(r.end), r.rank), xytext=(ms(s.start), s.rank),
                            arrowprops=dict(arrowstyle="->", color="#444444", lw=0.6, alpha=0.7))
    ranks = trace.ranks()
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    return ax


# ----------------------------------------------------------------------------- ZeRO memory
ZERO_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}


def plot_zero_memory(rows: list[dict], ax=None, title: str = "model states per rank (measured)",
                     unit: float = 1024, unit_name: str = "KiB"):
    """The ZeRO paper's Figure 1 from measurements: per stage, one stacked bar per rank
    (params, grads, optimizer states). ``rows`` are dicts with keys stage (label), rank,
    params, grads, optimizer (bytes) and optionally formula (total bytes), drawn as a
    black tick over the bar -- e.g. the rows of ``minidist bench zero --json``."""
    ax = _axes(ax, (8, 4))
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    ranks = sorted({r["rank"] for r in rows})
    width = 0.8 / max(len(ranks), 1)
    for r in rows:
        x = stages.index(r["stage"]) + (ranks.index(r["rank"]) - (len(ranks) - 1) / 2) * width
        bottom = 0.0
        for key, color in ZERO_COLORS.items():
            height = r[key] / unit
            ax.bar(x, height, width * 0.9, bottom=bottom, color=color, edgecolor="black", linewidth=0.4,
                   label=key if (r is rows[0]) else None)
            bottom += height
        if r.get("formula") is not None:
            ax.plot([x - width * 0.45, x + width * 0.45], [r["formula"] / unit] * 2, color="black", linewidth=1.5,
                    label="formula" if r is rows[0] else None)
    ax.set_xticks(range(len(stages)), [str(s) for s in stages])
    ax.set_ylabel(f"bytes per rank ({unit_name})")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title + (f", bars = ranks 0..{len(ranks) - 1}" if len(ranks) > 1 else ""))
    return ax


def plot_pipeline_side_by_side(simulated, measured, title: str = "", sim_unit: str = "cost units"):
    """The simulator's Gantt chart above the measured one (same schedule), as in the
    lecture's GPipe figure. Returns the figure."""
    import matplotlib.pyplot as plt

    p = max(s.rank for s in list(simulated) + list(measured)) + 1
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 1.2 + 0.9 * p), constrained_layout=True)
    plot_pipeline_gantt(simulated, top, f"{title} simulated".strip(), p, sim_unit)
    plot_pipeline_gantt(measured, bottom, f"{title} measured".strip(), p, "s")
    return fig


# --------------------------------------------------------------------------- data parallel
def plot_overlap_timeline(trace, ax=None, title: str = "compute and communication per rank",
                          ops=("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")):
    """Per rank, the compute spans (``minidist.trace.span``, green, top lane) above one thin
    lane per collective, each drawn from its launch to the moment ``wait()`` returned. An
    async collective that starts left of the end of a span overlapped that computation."""
    import matplotlib.patches as mpatches

    ranks = trace.ranks()
    ax = _axes(ax, (9, 0.8 + 1.3 * max(1, len(ranks))))
    events = [e for e in trace.events if e.op.startswith("span:") or e.op in ops]
    if not events:
        ax.set_title(f"{title} (no events)")
        return ax
    t0 = min(e.start for e in events)
    ms = lambda t: (t - t0) * 1e3
    colors = {"all_reduce": "#8c8c8c", "reduce_scatter_tensor": "#dd8452", "all_gather_into_tensor": "#4c72b0"}
    for row, r in enumerate(ranks):
        spans = [e for e in events if e.rank == r and e.op.startswith("span:")]
        comm = sorted((e for e in events if e.rank == r and e.op in ops), key=lambda e: e.start)
        for e in spans:
            ax.barh(row - 0.3, ms(e.end) - ms(e.start), left=ms(e.start), height=0.3, color="#55a868",
                    edgecolor="black", linewidth=0.4)
            ax.text(ms(e.start), row - 0.3, " " + e.op[5:], va="center", ha="left", fontsize=7, color="white")
        lane = 0.55 / max(len(comm), 1)
        for k, e in enumerate(comm):
            y = row - 0.1 + (k + 0.5) * lane
            ax.barh(y, max(ms(e.end) - ms(e.start), 1e-3), left=ms(e.start), height=lane * 0.8,
                    color=colors.get(e.op, "#8c8c8c"), edgecolor="black", linewidth=0.3)
            ax.plot(ms(e.start), y, "k|", markersize=4)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_xlabel("time (ms)")
    handles = [mpatches.Patch(color="#55a868", label="compute span")]
    handles += [mpatches.Patch(color=colors[o], label=o) for o in ops if any(e.op == o for e in events)]
    # outside the axes: the lanes fill them
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    return ax


# --------------------------------------------------------------------------------- overlap
def plot_timeline(trace, ax=None, title: str = "compute, communication and waits per rank"):
    """A run as :mod:`minidist.trace.timeline` sees it, one band per rank (rank 0 on top): compute
    (``compute()`` green, ``span()`` phases pale behind them), each communication from issue to
    completion (grey, stacked when several are in flight), and the waits (red), the exposed
    communication, whose total each rank's label gives. The same data as the Perfetto export."""
    import matplotlib.patches as mpatches

    from minidist.trace.timeline import exposed, waits

    ranks = trace.ranks()
    ax = _axes(ax, (9, 0.8 + 1.1 * max(1, len(ranks))))
    events = [e for e in trace.events if not e.op.startswith("api:")]
    if not events:
        ax.set_title(f"{title} (no events)")
        return ax
    t0 = min(e.start for e in events)
    ms = lambda t: (t - t0) * 1e3        # noqa: E731
    for row, r in enumerate(ranks):
        mine = [e for e in events if e.rank == r]
        for e in mine:
            if e.op.startswith(("span:", "compute:")):
                phase = e.op.startswith("span:")
                ax.barh(row - 0.25, ms(e.end) - ms(e.start), left=ms(e.start), height=0.4 if phase else 0.3,
                        color="#c7e9c0" if phase else "#55a868", edgecolor="black", linewidth=0.3,
                        zorder=1 if phase else 2)
        comm = sorted((e for e in mine if e.is_comm), key=lambda e: e.start)
        lane = 0.35 / max(1, min(len(comm), 4))
        for k, e in enumerate(comm):
            y = row + 0.05 + (k % 4 + 0.5) * lane
            ax.barh(y, max(ms(e.end) - ms(e.start), 1e-3), left=ms(e.start), height=lane * 0.8, color="#8c8c8c",
                    edgecolor="black", linewidth=0.2)
            for a, b in waits(e):
                ax.barh(y, max(ms(b) - ms(a), 1e-3), left=ms(a), height=lane * 0.8, color="#c44e52", zorder=3)
    labels = [f"rank {r}\nwaited {exposed(trace, r) * 1e3:.1f} ms" for r in ranks]
    ax.set_yticks(range(len(ranks)), labels, fontsize=8)
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_xlabel("time (ms)")
    handles = [mpatches.Patch(color=c, label=n) for c, n in (("#55a868", "compute"), ("#c7e9c0", "phase (span)"),
                                                             ("#8c8c8c", "communication in flight"),
                                                             ("#c44e52", "waiting (exposed)"))]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    return ax
