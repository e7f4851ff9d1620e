"""Diagrams of collectives, decoded from real runs: who holds what, who sends what to whom.

The buffers are *encoded*: element ``c`` of rank ``r``'s input is ``2**r + 16*c``, so any
sum of inputs still says which ranks contributed (the low bits) and which chunk it is
(the high part). A figure drawn from a run's outputs therefore shows exactly what the
algorithm computed, and one drawn from a trace shows exactly what it sent.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _contributors(value, n):
    """Cell values are sum over contributing ranks r of 2**r + 16*chunk: decode the ranks."""
    v = int(round(value))
    ranks = [r for r in range(n) if (v % 16) >> r & 1]
    chunk = (v // 16) // max(len(ranks), 1)
    return ranks, chunk


def encoded_input(rank, n, length):
    """Element c of rank r's input: 2**r + 16*c, so any sum of them tells who contributed."""
    return torch.tensor([2.0 ** rank + 16 * c for c in range(length)])


def draw_buffers(ax, rows, n, title, ncells=None):
    """rows[r]: None or a 1-D tensor of encoded cells, with an optional x-offset: (offset, tensor)."""
    ncells = ncells or n
    for r, row in enumerate(rows):
        y = n - 1 - r
        ax.text(-0.3, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=10)
        for c in range(ncells):
            ax.add_patch(plt.Rectangle((c, y), 0.92, 0.8, fill=False, ec="#dddddd", lw=1))
        if row is None:
            continue
        offset, values = row if isinstance(row, tuple) else (0, row)
        for i, v in enumerate(values.tolist()):
            ranks, chunk = _contributors(v, n)
            x = offset + i
            if len(ranks) == 1:
                color, label, tc = RANK_COLORS[ranks[0]], f"{'ABCDEFGH'[chunk]}{ranks[0]}", "white"
            else:
                shade = 0.85 - 0.55 * len(ranks) / n
                color, tc = (shade, shade, shade), ("white" if shade < 0.5 else "black")
                label = f"{'ABCDEFGH'[chunk]}Σ" if len(ranks) == n else f"{'ABCDEFGH'[chunk]}" + "".join(map(str, ranks))
            ax.add_patch(plt.Rectangle((x, y), 0.92, 0.8, color=color))
            ax.text(x + 0.46, y + 0.4, label, ha="center", va="center", color=tc, fontsize=9)
    ax.set_xlim(-1.4, ncells)
    ax.set_ylim(-0.2, n)
    ax.set_title(title, fontsize=11)
    ax.axis("off")


def draw_primitive(name, before, after, n):
    fig, (a, b) = plt.subplots(1, 2, figsize=(7.5, 2.2))
    draw_buffers(a, before, n, "before")
    draw_buffers(b, after, n, "after")
    fig.suptitle(name, fontsize=13, x=0.08, ha="left")
    fig.tight_layout()
    return fig


def draw_ring_buffers(snapshots, n, titles, ncols=3):
    """snapshots[r][k]: rank r's (encoded) buffer after step k; one panel per step."""
    steps = len(snapshots[0])
    rows = math.ceil(steps / ncols)
    fig, axes = plt.subplots(rows, ncols, figsize=(3.4 * ncols, 2.1 * rows))
    for k, ax in enumerate(np.atleast_1d(axes).flat):
        if k < steps:
            draw_buffers(ax, [snapshots[r][k] for r in range(n)], n, titles[k])
        else:
            ax.axis("off")
    fig.tight_layout()
    return fig


def ring_positions(n, radius=1.0):
    return [(radius * math.sin(2 * math.pi * r / n), radius * math.cos(2 * math.pi * r / n)) for r in range(n)]


def draw_message_steps(steps, n, titles, labels, ncols=3, curved=True):
    """One panel per step: ranks on a circle, an arrow per message, labelled."""
    rows = math.ceil(len(steps) / ncols)
    fig, axes = plt.subplots(rows, ncols, figsize=(3.2 * ncols, 3.0 * rows))
    pos = ring_positions(n)
    for k, ax in enumerate(np.atleast_1d(axes).flat):
        ax.set_aspect("equal")
        ax.axis("off")
        if k >= len(steps):
            continue
        for r, (x, y) in enumerate(pos):
            ax.add_patch(plt.Circle((x, y), 0.22, color=RANK_COLORS[r], zorder=3))
            ax.text(x, y, str(r), ha="center", va="center", color="white", zorder=4, fontsize=11)
        pairs = {(s, d) for s, d in steps[k]}
        for (src, dst), label in zip(steps[k], labels[k]):
            (x0, y0), (x1, y1) = pos[src], pos[dst]
            swap = (dst, src) in pairs            # a pairwise exchange: one label, centred
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops=dict(arrowstyle="-|>", color=RANK_COLORS[src], lw=1.8,
                                        shrinkA=14, shrinkB=14,
                                        connectionstyle="arc3,rad=0.25" if curved else "arc3"))
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            if swap:
                if src < dst:
                    ax.text(mx, my, label + " each way", ha="center", va="center", fontsize=9,
                            bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="#cccccc"), zorder=5)
                continue
            # push the label outwards, to the side the arc bends to
            dx, dy = y1 - y0, x0 - x1
            norm = math.hypot(dx, dy) or 1
            off = 0.28 if curved else 0.12
            ax.text(mx - off * dx / norm, my - off * dy / norm, label, ha="center", va="center",
                    fontsize=9, color=RANK_COLORS[src], fontweight="bold")
        ax.set_xlim(-1.5, 1.5)
        ax.set_ylim(-1.5, 1.5)
        ax.set_title(titles[k], fontsize=10)
    fig.tight_layout()
    return fig

def ring_steps_from_trace(t):
    """[(phase, step)] -> list of (src, dst, chunk, bytes), from isend events inside step spans."""
    spans = [e for e in t.events if e.op.startswith("span:")]
    steps = {}
    for e in t.comm():
        if not e.is_send:
            continue
        sp = next(s for s in spans if s.rank == e.rank and s.start <= e.start <= s.end)
        key = (0 if sp.op == "span:reduce-scatter" else 1, sp.meta["step"])
        steps.setdefault(key, []).append((e.rank, e.peer, sp.meta["send_chunk"], e.nbytes))
    return [steps[k] for k in sorted(steps)], sorted(steps)


def draw_ring_steps(t, n):
    """One panel per ring step: an arrow per traced send, labelled with its chunk and bytes."""
    steps, keys = ring_steps_from_trace(t)
    return draw_message_steps(
        [[(s, d) for s, d, _, _ in step] for step in steps], n,
        [f"{'reduce-scatter' if p == 0 else 'all-gather'} step {s}" for p, s in keys],
        [[f"{'ABCDEFGH'[c]} ({b} B)" for _, _, c, b in step] for step in steps])


def draw_rounds(t, n):
    """One panel per round (the k-th send of every rank), for pairwise algorithms."""
    by_round = {}
    for r in range(n):
        for k, e in enumerate(e for e in t.select(rank=r).comm() if e.is_send):
            by_round.setdefault(k, []).append((e.rank, e.peer, e.nbytes))
    ks = sorted(by_round)
    return draw_message_steps(
        [[(s, d) for s, d, _ in by_round[k]] for k in ks], n,
        [f"round {k + 1}: partner = rank XOR {by_round[k][0][0] ^ by_round[k][0][1]}" for k in ks],
        [[f"{b} B" for _, _, b in by_round[k]] for k in ks], ncols=len(ks))


def draw_f_g_split(t: int = 2, title: str | None = None):
    """Megatron's MLP over ``t`` ranks (Shoeybi et al. 2019, Fig. 3a): the replicated X enters through f
    (identity forward, all-reduce backward), rank r computes GeLU(X A_rᵀ) with its rows A_r of the first
    weight (column-parallel) and multiplies by its columns B_r of the second (row-parallel), and g
    (all-reduce forward, identity backward) sums the t partial outputs into the replicated Y."""
    fig, ax = plt.subplots(figsize=(10, 1.6 + 1.1 * t))
    mid = (t - 1) / 2

    def box(x, y, w, text, color, tc="white", size=10):
        ax.add_patch(plt.Rectangle((x - w / 2, y - 0.34), w, 0.68, color=color, ec="none"))
        ax.text(x, y, text, ha="center", va="center", color=tc, fontsize=size)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color="#444444", lw=1.2))

    box(0, mid, 1.3, "X\n(replicated)", "#dddddd", "black")
    box(1.65, mid, 0.7, "f", "#333333", size=12)
    box(9.1, mid, 0.7, "g", "#333333", size=12)
    box(10.75, mid, 1.3, "Y\n(replicated)", "#dddddd", "black")
    arrow(0.65, mid, 1.3, mid)
    arrow(9.45, mid, 10.1, mid)
    for r in range(t):
        y, color = t - 1 - r, RANK_COLORS[r % len(RANK_COLORS)]
        arrow(2.0, mid, 2.7, y)
        box(3.7, y, 2.0, f"X A{r}\u1d40\nrows {r} of A", color, size=9)
        arrow(4.7, y, 5.05, y)
        box(5.5, y, 0.9, "GeLU", color, size=9)
        arrow(5.95, y, 6.35, y)
        box(7.35, y, 2.0, f"\u00b7 B{r}\u1d40\ncolumns {r} of B", color, size=9)
        arrow(8.35, y, 8.75, mid)
    ax.text(1.65, -0.6, "f: forward identity\nbackward all-reduce", ha="center", va="top", fontsize=9)
    ax.text(9.1, -0.6, "g: forward all-reduce\n(sums the partial outputs)\nbackward identity", ha="center",
            va="top", fontsize=9)
    ax.text(3.7, t - 0.55, "column-parallel", ha="center", va="bottom", fontsize=9, style="italic")
    ax.text(7.35, t - 0.55, "row-parallel", ha="center", va="bottom", fontsize=9, style="italic")
    ax.set_xlim(-0.8, 11.5)
    ax.set_ylim(-1.7, t - 0.2)
    ax.axis("off")
    ax.set_title(title or f"Megatron's MLP on {t} ranks: one f, one g", fontsize=11)


# ----------------------------------------------------------------------------- context parallelism (lab 6)
def draw_ring_attention_passes(p: int = 4, causal: bool = True):
    """Ring attention's K/V passes (Liu et al. 2023, Alg. 1): row r is rank r, column i step i; the
    cell is the K/V block rank r holds then, block (r − i) mod P, coloured by its owner. Causal with
    contiguous shards: its own block is the diagonal (triangle mask, "◣"), earlier blocks are
    attended in full, later ones only pass through (hatched: skipped). Arrows: each block moves to
    rank r + 1 between steps, P − 1 passes in all."""
    fig, ax = plt.subplots(figsize=(1.3 * p + 2, 0.75 * p + 1.2))
    for r in range(p):
        y = p - 1 - r
        ax.text(-0.25, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=10)
        for i in range(p):
            src = (r - i) % p
            skipped = causal and src > r
            ax.add_patch(plt.Rectangle((i, y), 0.8, 0.8, color=RANK_COLORS[src % len(RANK_COLORS)],
                                       alpha=0.25 if skipped else 0.9, hatch="//" if skipped else None))
            mark = "◣" if causal and src == r else ("skip" if skipped else "full")
            ax.text(i + 0.4, y + 0.4, f"KV{src}\n{mark}", ha="center", va="center", fontsize=8,
                    color="black" if skipped else "white")
            if i < p - 1 and r < p - 1:
                ax.annotate("", xy=(i + 1.02, y - 0.6), xytext=(i + 0.78, y + 0.05),
                            arrowprops=dict(arrowstyle="->", color="#888888", lw=0.8))
    for i in range(p):
        ax.text(i + 0.4, p + 0.05, f"step {i}", ha="center", fontsize=9)
    ax.set_xlim(-1.3, p)
    ax.set_ylim(-0.3, p + 0.4)
    ax.set_title(f"ring attention, P = {p}{', causal' if causal else ''}: the block each rank holds "
                 "(→ passed to rank r+1)", fontsize=10)
    ax.axis("off")
    return fig


def draw_zigzag_layout(p: int = 4, chunk: int = 2, shards=None):
    """Contiguous vs zigzag shards of a causal sequence of 2P chunks (Brandon et al. 2023; chunks r
    and 2P−1−r go to rank r). Top of each panel: which rank holds each position; below: the causal
    score matrix, each unmasked score coloured by the rank whose query computes it, with each
    rank's count. ``shards``: per rank, the global positions it holds (e.g. from your
    ``zigzag_shard(torch.arange(s)[None])``) instead of the formula's."""
    s = 2 * p * chunk
    chunks = np.arange(s).reshape(2 * p, chunk)
    layouts = {"contiguous": [np.arange(r * s // p, (r + 1) * s // p) for r in range(p)],
               "zigzag": ([np.asarray(x).reshape(-1) for x in shards] if shards is not None
                          else [np.concatenate([chunks[r], chunks[2 * p - 1 - r]]) for r in range(p)])}
    fig, axes = plt.subplots(1, 2, figsize=(10, 5.2))
    for ax, (name, held) in zip(axes, layouts.items()):
        owner = np.full(s, -1)
        for r, pos in enumerate(held):
            owner[pos] = r
        img = np.ones((s + 2, s, 3))
        for q in range(s):
            img[0, q] = img[1, q] = plt.matplotlib.colors.to_rgb(RANK_COLORS[owner[q] % len(RANK_COLORS)])
            for k in range(q + 1):
                img[q + 2, k] = plt.matplotlib.colors.to_rgb(RANK_COLORS[owner[q] % len(RANK_COLORS)])
        ax.imshow(img, interpolation="nearest", aspect="equal")
        ax.axhline(1.5, color="black", lw=1)
        work = [int(sum(q + 1 for q in pos)) for pos in held]
        ax.set_title(f"{name}: scores per rank " + " / ".join(map(str, work)), fontsize=10)
        ax.set(xlabel="key position", ylabel="query position (top strip: owner)", xticks=[], yticks=[])
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[r % len(RANK_COLORS)]) for r in range(p)]
    fig.legend(handles, [f"rank {r}" for r in range(p)], loc="lower center", ncol=p, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ----------------------------------------------------------------------------- ring all-reduce, step by step
def ring_all_reduce_snapshots(n: int = 4):
    """Every rank's encoded buffer (one element per chunk) before the ring all-reduce and after each of
    its 2(N−1) steps, computed by the schedule itself (no launch): at step s of the reduce-scatter rank r
    sends chunk (r−s−1) mod N to its right and adds the chunk (r−s−2) mod N it receives from its left;
    at step s of the all-gather it sends chunk (r−s) mod N and overwrites chunk (r−s−1) mod N.
    Returns (snapshots[r][k], titles[k])."""
    bufs = [encoded_input(r, n, n) for r in range(n)]
    snaps = [[b.clone()] for b in bufs]
    titles = ["start\nrank r holds its input"]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            sent = [((r - s - 1) if phase == "reduce-scatter" else (r - s)) % n for r in range(n)]
            incoming = [bufs[(r - 1) % n][sent[(r - 1) % n]].clone() for r in range(n)]   # from the left
            for r in range(n):
                c = sent[(r - 1) % n]
                bufs[r][c] = bufs[r][c] + incoming[r] if phase == "reduce-scatter" else incoming[r]
                snaps[r].append(bufs[r].clone())
            k = s + 1 if phase == "reduce-scatter" else s
            titles.append(f"{phase} {s + 1}/{n - 1}\nrank r sends chunk {'r' if k == 0 else f'(r−{k}) mod {n}'}")
    return snaps, titles


def draw_ring_all_reduce(n: int = 4):
    """The ring all-reduce's buffers step by step (lab 1, lecture 1): chunks A, B, ... of every rank,
    coloured by the ranks whose inputs they hold (Σ: all of them). Row 1: the reduce-scatter, after which
    rank r holds the sum of one chunk; row 2: the all-gather, which copies the sums around the ring."""
    snaps, titles = ring_all_reduce_snapshots(n)
    return draw_ring_buffers(snaps, n, titles, ncols=n)
