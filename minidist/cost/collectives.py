"""Cost of collectives: the α-β-γ model of lecture 1.

Sections:
  1. α-β-γ time of every all-reduce algorithm       (Hockney 1994; Thakur, Rabenseifner
                                                      & Gropp, IJHPCA 2005)
  2. the lecture's table: time, peak node bandwidth, total bandwidth
  3. bytes per rank, exact (chunk rounding included), for tests, the tour and labs
  4. nccl-tests bandwidth conventions: algbw, busbw
  5. fitting α and β to measured timings

Notation: n ranks, S bytes per rank (the tensor being reduced), α seconds of latency
per message, β seconds per byte on a link (1/bandwidth), γ seconds per byte of
reduction arithmetic. A model is linear in (α, β, γ): ``T = a·α + b·S·β + g·S·γ``, and
each algorithm is described by its coefficients (a, b, g) -- this is what makes the
least-squares fit of section 5 a one-liner.

Ports. Thakur et al. assume a node sends one message and receives one at a time
("single"). The lecture's table lets a node drive all of its links at once ("multi"),
which is what makes the parameter server O(1) in time but O(n) in peak node bandwidth.
Ring, recursive halving and tree only ever use one link per direction per step, so both
assumptions give them the same time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# =========================================================================== 1. α-β-γ time
ALLREDUCE_ALGORITHMS = ("parameter_server", "naive", "parallel", "tree", "ring",
                        "recursive_doubling", "recursive_halving", "fast_ring")


def _lg(n: int) -> int:
    return max(0, math.ceil(math.log2(n)))


def allreduce_terms(algorithm: str, n: int, ports: str = "single") -> tuple[float, float, float]:
    """Coefficients (a, b, g) with ``T = a·α + b·S·β + g·S·γ`` for an all-reduce of S bytes.

    parameter_server  multi: 2α + 2Sβ + (n-1)Sγ        single: 2(n-1)(α + Sβ) + (n-1)Sγ
    naive             2(n-1)(α + Sβ) + (n-1)Sγ          (reduce to 0, broadcast; one peer at a time)
    parallel          multi: α + Sβ + (n-1)Sγ           single: (n-1)(α + Sβ) + (n-1)Sγ
    tree              2⌈lg n⌉(α + Sβ) + ⌈lg n⌉Sγ        (binomial reduce + broadcast)
    ring, fast_ring   2(n-1)α + 2(n-1)/n·Sβ + (n-1)/n·Sγ          (Thakur et al. §4.4)
    recursive_doubling lg n·(α + Sβ + Sγ), n = 2^k: lg n rounds, partners at distances
                      1, 2, 4, ..., each swapping the *whole* vector (Thakur et al. §4.4);
                      otherwise lg p with p = 2^⌊lg n⌋, plus 2(α + Sβ) + Sγ for the fold.
    recursive_halving 2 lg n·α + 2(n-1)/n·Sβ + (n-1)/n·Sγ, n = 2^k (Rabenseifner: reduce-
                      scatter by recursive halving, then all-gather by recursive doubling);
                      otherwise lg p with p = 2^⌊lg n⌋, plus 2(α + Sβ) + Sγ for the fold.
    """
    if ports not in ("single", "multi"):
        raise ValueError(f"ports must be 'single' or 'multi', got {ports!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if n == 1:
        return (0.0, 0.0, 0.0)
    m = n - 1
    if algorithm == "parameter_server":
        return (2.0, 2.0, m) if ports == "multi" else (2.0 * m, 2.0 * m, m)
    if algorithm == "naive":
        return (2.0 * m, 2.0 * m, m)
    if algorithm == "parallel":
        return (1.0, 1.0, m) if ports == "multi" else (m, m, m)
    if algorithm == "tree":
        return (2.0 * _lg(n), 2.0 * _lg(n), _lg(n))
    if algorithm in ("ring", "fast_ring"):
        return (2.0 * m, 2.0 * m / n, m / n)
    if algorithm == "recursive_doubling":
        p = 1 << (n.bit_length() - 1)
        a = b = g = float(_lg(p))
        return (a, b, g) if p == n else (a + 2.0, b + 2.0, g + 1.0)
    if algorithm == "recursive_halving":
        p = 1 << (n.bit_length() - 1)
        a, b, g = 2.0 * _lg(p), 2.0 * (p - 1) / p, (p - 1) / p
        return (a, b, g) if p == n else (a + 2.0, b + 2.0, g + 1.0)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; known: {', '.join(ALLREDUCE_ALGORITHMS)}")


def allreduce_time(algorithm: str, n: int, nbytes: float, alpha: float, beta: float,
                   gamma: float = 0.0, ports: str = "single") -> float:
    """Predicted seconds for an all-reduce of ``nbytes`` per rank (see :func:`allreduce_terms`)."""
    a, b, g = allreduce_terms(algorithm, n, ports)
    return a * alpha + b * nbytes * beta + g * nbytes * gamma


def p2p_time(nbytes: float, alpha: float, beta: float) -> float:
    """One message: T = α + Sβ (Hockney)."""
    return alpha + nbytes * beta


# =========================================================================== 2. lecture table
@dataclass(frozen=True)
class TableRow:
    algorithm: str
    time: str                   # growth of the time in n (lecture: links run in parallel)
    peak_node_bandwidth: str    # growth of the busiest node's bytes over the whole all-reduce
    total_bandwidth: str        # bytes on all links together
    peak_node_bytes: float      # exact, for n and S (S = 1 when not given)
    total_bytes: float


# (time, peak node bandwidth, total bandwidth). Peak node bandwidth is the bytes the busiest
# node sends over the whole all-reduce: what its link must carry, so what the operation
# costs in the bandwidth regime (the β term of a one-port node), and what a trace measures
# as max(bytes_sent). Errata: the lecture's table counts the sequential (naive) all-reduce
# as O(N) here and the ring as O(1), which this definition keeps; an earlier version of this
# table counted bytes per *step* instead, giving naive O(1), which hides rank 0 moving (N-1)·S.
_BIG_O = {
    "parameter_server": ("O(1)", "O(N)", "O(N)"),
    "naive": ("O(N)", "O(N)", "O(N)"),
    "ring": ("O(N)", "O(1)", "O(N)"),
    "parallel": ("O(1)", "O(N)", "O(N^2)"),
    "recursive_doubling": ("O(log N)", "O(log N)", "O(N log N)"),
    "recursive_halving": ("O(log N)", "O(1)", "O(N)"),
    "tree": ("O(log N)", "O(log N)", "O(N)"),
}


def peak_node_bytes(algorithm: str, n: int, nbytes: float = 1.0) -> float:
    """Bytes the busiest node sends over the whole all-reduce of ``nbytes`` per rank
    (nominal, no chunk rounding): max over ranks of :func:`allreduce_bytes_per_rank`'s sent.

    parameter server, naive: the root sends S to each of n-1 others; parallel: every node
    sends S to n-1 others; tree: the root sends S to ⌈lg n⌉ children; ring and recursive
    halving: 2(n-1)/n·S; recursive doubling: lg n·S (on n ≠ 2^k, plus S for a folded partner)."""
    if n == 1:
        return 0.0
    if algorithm in ("parameter_server", "naive", "parallel"):
        return (n - 1) * nbytes
    if algorithm == "tree":
        return _lg(n) * nbytes
    if algorithm in ("ring", "fast_ring"):
        return ring_bytes_nominal(n, nbytes)
    p = 1 << (n.bit_length() - 1)
    fold = nbytes if p != n else 0.0
    if algorithm == "recursive_doubling":
        return _lg(p) * nbytes + fold
    if algorithm == "recursive_halving":
        return ring_bytes_nominal(p, nbytes) + fold
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")


def total_bytes(algorithm: str, n: int, nbytes: float = 1.0) -> float:
    """Bytes sent by all nodes together (nominal, no chunk rounding)."""
    if algorithm == "parallel":
        return n * (n - 1) * nbytes
    if algorithm == "recursive_doubling":
        p = 1 << (n.bit_length() - 1)
        return p * _lg(p) * nbytes + 2 * (n - p) * nbytes
    if algorithm == "recursive_halving" and n & (n - 1):
        p = 1 << (n.bit_length() - 1)
        return 2 * (p - 1) * nbytes + 2 * (n - p) * nbytes
    return 2 * (n - 1) * nbytes     # PS, naive, tree, ring: 2(n-1) messages' worth of S


def allreduce_table(n: int = 8, nbytes: float = 1.0) -> list[TableRow]:
    """The lecture's comparison of all-reduce algorithms, with exact numbers for n, S."""
    return [TableRow(alg, *_BIG_O[alg], peak_node_bytes(alg, n, nbytes), total_bytes(alg, n, nbytes))
            for alg in ("parameter_server", "naive", "ring", "parallel", "recursive_doubling",
                        "recursive_halving", "tree")]


# =========================================================================== 3. bytes per rank
def chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of ``tensor.tensor_split(n)``: the first numel % n chunks get one more."""
    q, r = divmod(numel, n)
    return [q + (i < r) for i in range(n)]


def ring_bytes_nominal(n: int, nbytes: float) -> float:
    """What each rank sends in a ring all-reduce: 2(n-1)/n·S (Patarasuk & Yuan)."""
    return 2 * (n - 1) / n * nbytes


def allreduce_bytes_per_rank(algorithm: str, n: int, numel: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Exact (bytes sent, bytes received) of each rank for minidist's implementation of
    ``algorithm`` on a tensor of ``numel`` elements, chunked with ``tensor_split``."""
    L, e = numel, itemsize
    if n == 1:
        return [(0, 0)]
    if algorithm in ("parameter_server", "naive"):
        return [((n - 1) * L * e, (n - 1) * L * e)] + [(L * e, L * e)] * (n - 1)
    if algorithm == "parallel":
        return [((n - 1) * L * e, (n - 1) * L * e)] * n
    if algorithm in ("ring", "fast_ring"):
        c = chunk_sizes(L, n)
        return [((2 * L - c[r] - c[(r + 1) % n]) * e, (2 * L - c[(r - 1) % n] - c[r]) * e) for r in range(n)]
    if algorithm == "tree":
        def children(v):
            low = v & -v if v else 1 << _lg(n)
            return sum(1 for k in range(_lg(n)) if (1 << k) < low and v + (1 << k) < n)
        return [((children(v) + (v > 0)) * L * e,) * 2 for v in range(n)]
    if algorithm == "recursive_halving":
        return _halving_bytes(n, L, e)
    if algorithm == "recursive_doubling":     # whole vectors; folded pairs as for halving
        p = 1 << (n.bit_length() - 1)
        rem, k = n - p, _lg(p)
        return [(L * e, L * e) if r < 2 * rem and r % 2 == 0 else
                ((k + (r < 2 * rem)) * L * e,) * 2 for r in range(n)]
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")


def _halving_bytes(n: int, L: int, e: int) -> list[tuple[int, int]]:
    """Rabenseifner's schedule on p = 2^⌊lg n⌋ blocks: in each halving round a rank sends
    the half of its block range it gives up and receives the same amount; the doubling
    rounds mirror this. Folded ranks (n not a power of two) move the whole tensor twice."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    blocks = chunk_sizes(L, p)
    out = []
    for r in range(n):
        if r < 2 * rem and r % 2 == 0:
            out.append((L * e, L * e))
            continue
        v = r // 2 if r < 2 * rem else r - rem
        lo, hi, d, sent, recv, trail = 0, p, 1, 0, 0, []
        while d < p:
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
            sent += sum(blocks[give[0]:give[1]])
            recv += sum(blocks[keep[0]:keep[1]])
            trail.append((lo, hi))
            lo, hi = keep
            d <<= 1
        for plo, phi in reversed(trail):       # doubling: send mine, receive the sibling half
            sent += sum(blocks[lo:hi])
            recv += sum(blocks[plo:phi]) - sum(blocks[lo:hi])
            lo, hi = plo, phi
        extra = L if r < 2 * rem else 0       # odd folded partner: receives S, sends S back
        out.append(((sent + extra) * e, (recv + extra) * e))
    return out


# =========================================================================== 4. nccl-tests bandwidths
BUSBW_FACTOR = {   # busbw = algbw · factor(n): what one link carries, comparable across n
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes/s: the tensor size over the time (nccl-tests PERFORMANCE.md)."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, n: int, collective: str = "all_reduce") -> float:
    """Bus bandwidth, bytes/s: algbw scaled so it reads as link speed, independent of n."""
    return algbw(nbytes, seconds) * BUSBW_FACTOR[collective](n)


# =========================================================================== 5. fitting α, β
@dataclass(frozen=True)
class Fit:
    alpha: float        # seconds per message
    beta: float         # seconds per byte (1/beta = link bandwidth in B/s)
    algorithm: str | None
    n: int
    rel_rms: float      # root-mean-square relative error of the fit on its own points

    def predict(self, nbytes: float) -> float:
        if self.algorithm is None:
            return p2p_time(nbytes, self.alpha, self.beta)
        return allreduce_time(self.algorithm, self.n, nbytes, self.alpha, self.beta)


def fit_alpha_beta(sizes, times, algorithm=None, n: int = 2) -> Fit:
    """Least-squares α, β from measured (bytes, seconds) points.

    The model is ``t = a·α + b·S·β`` with (a, b) from :func:`allreduce_terms` (or a = b = 1
    for a single message, ``algorithm=None``); γ is folded into β. ``algorithm`` may also
    be a sequence, one name per point, to fit one (α, β) to several algorithms at once. Errors are weighted
    by 1/t, i.e. we minimise *relative* error, otherwise the largest message decides
    everything and α comes out as noise. α and β are kept non-negative (if the free fit
    makes one negative, it is pinned to 0 and the other refitted).
    """
    S = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if S.shape != t.shape or S.ndim != 1 or len(S) < 2:
        raise ValueError("need at least two (size, time) points, as two equal-length 1-D sequences")
    if np.any(t <= 0) or np.any(S < 0):
        raise ValueError("times must be > 0 and sizes >= 0")
    names = list(algorithm) if isinstance(algorithm, (list, tuple)) else [algorithm] * len(S)
    if len(names) != len(S):
        raise ValueError("one algorithm name per point, or a single name")
    coef = np.array([(1.0, 1.0) if a is None else allreduce_terms(a, n)[:2] for a in names])
    a, b = coef[:, 0], coef[:, 1]
    if not np.any(a) and not np.any(b):
        raise ValueError("a 1-rank all-reduce has no communication to fit")
    X = np.stack([a, b * S], axis=1) / t[:, None]
    y = np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(X, y, rcond=None)
    if alpha < 0 or beta < 0:
        keep = 1 if alpha < 0 else 0
        coef = float(np.linalg.lstsq(X[:, keep:keep + 1], y, rcond=None)[0][0])
        alpha, beta = (0.0, max(coef, 0.0)) if keep == 1 else (max(coef, 0.0), 0.0)
    pred = a * alpha + b * S * beta
    rel_rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return Fit(float(alpha), float(beta), algorithm if not isinstance(algorithm, (list, tuple)) else None, n, rel_rms)
