"""Cost of context parallelism: bytes per rank of Ulysses and ring attention, causal work per rank.

Notation: b batch, s sequence length, h query heads, h_kv key/value heads (GQA/MQA), d head
dim, P context-parallel ranks, e bytes per element. Bytes are *payloads as
``minidist.trace`` records them* (an all-to-all counts its whole input, an isend its
message), as :class:`~minidist.cost.tensor_parallel.TPCollective` lists, so
``tp_payload_bytes`` sums them and ``tp_wire_bytes`` gives what actually leaves the rank.

**Ulysses** (Jacobs et al. 2023, Sec. 3.2): 4 all-to-alls forward (q, k, v, out) and their
4 swapped versions backward, each on a (b, s/P, heads, d) shard. q and out carry h heads,
k and v h_kv heads when P divides h_kv, else P heads (one replica per rank, see
``minidist.context_parallel.ulysses``). Wire bytes per all-to-all: (P−1)/P of its input,
so per rank 8·(P−1)/P·b·(s/P)·d·e·(h + h_kv): O(s/P), shrinking as P grows.

**Ring attention** (Liu et al. 2023, Sec. 3): forward P−1 passes of the (k, v) block,
2·b·(s/P)·h_kv·d·e each; backward P−1 passes of (k, v) again and P passes of (dk, dv) in
the accumulation dtype (e_acc = max(e, 4)). Per rank ≈ 2(P−1)/P·b·s·h_kv·d·e forward: it
grows with s and barely with P, and only the kv heads travel, so GQA/MQA cut it by h/h_kv
(Ulysses' kv traffic is cut too, but never below P heads' worth).

**Causal work per rank** (Brandon et al. 2023, "Striped Attention", Sec. 3), counted in
score entries per (batch, head): :func:`causal_scores` the unmasked ones (the useful
work, the same in every implementation), :func:`ring_computed_scores` the entries our
ring computes (its windows, masked entries of diagonal blocks included).
"""
from __future__ import annotations

from minidist.cost.tensor_parallel import TPCollective

A2A, SEND = "all_to_all_single", "isend"


def _check(s: int, p: int, parts: int = 1) -> int:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"context-parallel size must be an int >= 1, got {p!r}")
    if s % (p * parts):
        raise ValueError(f"sequence length {s} is not divisible by {p * parts}")
    return s // (p * parts)


def ulysses_kv_heads(h: int, h_kv: int, p: int) -> int:
    """Kv heads in Ulysses' all-to-all input: h_kv split, or P replicas when P % h_kv == 0."""
    if h % p:
        raise ValueError(f"Ulysses needs h ({h}) divisible by P ({p})")
    if h_kv % p == 0:
        return h_kv
    if p % h_kv == 0:
        return p
    raise ValueError(f"{h_kv} kv heads fit {p} ranks neither split nor replicated")


def ulysses_collectives(b: int, s: int, h: int, d: int, p: int, h_kv: int | None = None,
                        elem_bytes: int = 4) -> list[TPCollective]:
    """The 8 all-to-alls of one Ulysses attention (forward + backward), per rank."""
    local = _check(s, p)
    if p == 1:
        return []
    kv = ulysses_kv_heads(h, h if h_kv is None else h_kv, p)
    q_bytes, kv_bytes = b * local * h * d * elem_bytes, b * local * kv * d * elem_bytes
    one_way = [q_bytes, kv_bytes, kv_bytes, q_bytes]         # q, k, v in; out back
    return [TPCollective(phase, A2A, n) for phase in ("forward", "backward") for n in one_way]


def ring_attention_messages(b: int, s: int, h_kv: int, d: int, p: int, elem_bytes: int = 4,
                            grad_elem_bytes: int | None = None) -> list[TPCollective]:
    """The isends of one ring attention (forward + backward), per rank."""
    local = _check(s, p)
    if p == 1:
        return []
    block = 2 * b * local * h_kv * d                            # k and v together
    grad_e = max(elem_bytes, 4) if grad_elem_bytes is None else grad_elem_bytes
    return ([TPCollective("forward", SEND, block * elem_bytes)] * (p - 1)
            + [TPCollective("backward", SEND, block * elem_bytes)] * (p - 1)
            + [TPCollective("backward", SEND, block * grad_e)] * p)


def hybrid_collectives(b: int, s: int, h: int, d: int, ring_size: int, ulysses_size: int, h_kv: int | None = None,
                       elem_bytes: int = 4) -> list[TPCollective]:
    """2D sequence parallelism (Fang & Zhao 2024, USP): Ulysses' all-to-alls inside a group
    of U ranks on s/R tokens, then the ring over R groups with the kv heads a rank holds
    after the all-to-all (h_kv/U split, or 1 replica)."""
    h_kv = h if h_kv is None else h_kv
    kv_after = ulysses_kv_heads(h, h_kv, ulysses_size) // ulysses_size
    return (ulysses_collectives(b, s // ring_size, h, d, ulysses_size, h_kv, elem_bytes)
            + ring_attention_messages(b, s, kv_after, d, ring_size, elem_bytes))


def causal_scores(s: int, p: int, zigzag: bool = False) -> list[int]:
    """Unmasked causal score entries of each rank's queries (query i sees i + 1 keys)."""
    c = _check(s, p, 2 if zigzag else 1)
    rows = lambda chunk: c * chunk * c + c * (c + 1) // 2       # noqa: E731  (chunk's queries, c keys each later)
    if zigzag:
        return [rows(r) + rows(2 * p - 1 - r) for r in range(p)]
    return [rows(r) for r in range(p)]


def ring_computed_scores(s: int, p: int, causal: bool = True, zigzag: bool = False) -> list[int]:
    """Score entries our ring evaluates per rank (the visible windows of its blocks).

    Non-causal: P full blocks of (s/P)². Causal contiguous: r + 1 blocks (own + earlier).
    Causal zigzag (chunks of c = s/2P): the own block (2c)² and P − 1 half blocks of 2c²,
    2(P + 1)c² on every rank."""
    if not causal:
        return [p * _check(s, p) ** 2] * p
    if zigzag:
        c = _check(s, p, 2)
        return [2 * (p + 1) * c * c] * p
    c = _check(s, p)
    return [(r + 1) * c * c for r in range(p)]


def imbalance(work: list[float]) -> float:
    """Most-loaded rank over the mean: 1.0 is perfect balance, the step waits for the max."""
    return max(work) / (sum(work) / len(work))
