"""Cost of expert parallelism: the all-to-all bytes of dispatch and combine, load imbalance, time.

Notation: T tokens on a rank, h hidden size, k experts per token (top-k), E experts over an
expert-parallel group of e ranks, cf the capacity factor (None: dropless), b bytes per
element. Lepikhin et al. 2021 ("GShard", Sec. 2.2, 3.2); Fedus et al. 2022 ("Switch
Transformers", Sec. 2.2); the scheme is ``minidist.expert_parallel.dispatch``'s.

**Rows.** A rank sends A rows (its kept (token, choice) pairs) and receives R rows (the
pairs of the group that chose its experts). Dropless, A = T·k. With capacity
C = ceil(cf·T·k/E) per expert, A ≤ E·C, and under balanced routing (every expert chosen
T·k/E times on every rank) A = R = min(T·k, E·C) exactly.

**Payloads** per rank per MoE layer, as ``minidist.trace`` records them (an all-to-all its
whole input, own share included), for e > 1:

    forward   counts 8·E  +  dispatch A·h·b  +  combine R·h·b
    backward  combine's backward A·h·b  +  dispatch's backward R·h·b

so 2(A + R)·h·b + 8E in all, ≈ 4·T·k·h·b balanced: it grows with k and the tokens, not
with E or e. What leaves the rank is (e−1)/e of it under balanced routing (the rows for
its own experts stay). A group of one rank sends nothing.

**Load imbalance**: rows per rank (the sum over its E/e experts) most-loaded over mean:
the step waits for the busiest expert rank, so a skewed router costs time as well as quality.

**Time** (α-β, :func:`ep_comm_time`): each token all-to-all is e−1 messages of the
(e−1)/e·A·h·b a rank sends; 4 per layer and micro-batch plus the counts, none overlapped.
FLOPs: :func:`moe_layer_flops`, k experts' MLPs per token (the parameters grow with E, the
compute with k).
"""
from __future__ import annotations

import math

from minidist.cost.context_parallel import imbalance
from minidist.cost.tensor_parallel import Link, TPCollective

A2A = "all_to_all_single"
COUNT_BYTES = 8                 # one int64 count per expert

__all__ = ["COUNT_BYTES", "ep_rows", "ep_collectives", "ep_layer_collectives", "ep_bytes_per_rank", "rank_loads",
           "expert_load_imbalance", "ep_comm_time", "moe_layer_flops", "moe_activation_bytes"]


def _check(num_experts: int, e: int, top_k: int = 1, capacity_factor: float | None = None) -> None:
    if not isinstance(e, int) or e < 1 or not isinstance(num_experts, int) or num_experts % e:
        raise ValueError(f"{num_experts!r} experts do not split over an expert-parallel group of {e!r} ranks")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top-k must be in 1..{num_experts}, got {top_k!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None, dropless), got {capacity_factor!r}")


def ep_rows(tokens: int, num_experts: int, top_k: int, capacity_factor: float | None = None) -> int:
    """Rows a rank sends (and receives) under balanced routing: T·k dropless, min(T·k, E·C) with capacity."""
    _check(num_experts, 1, top_k, capacity_factor)
    if capacity_factor is None:
        return tokens * top_k
    return min(tokens * top_k, num_experts * math.ceil(capacity_factor * tokens * top_k / num_experts))


def ep_collectives(sent_rows: int, received_rows: int, hidden: int, num_experts: int, e: int,
                   elem_bytes: int = 4) -> list[TPCollective]:
    """The all-to-alls of one MoE layer (forward and backward) on a rank that sends ``sent_rows``
    and receives ``received_rows``: exact, whatever the routing."""
    _check(num_experts, e)
    if e == 1:
        return []
    out_bytes, in_bytes = sent_rows * hidden * elem_bytes, received_rows * hidden * elem_bytes
    return [TPCollective("forward", A2A, COUNT_BYTES * num_experts), TPCollective("forward", A2A, out_bytes),
            TPCollective("forward", A2A, in_bytes), TPCollective("backward", A2A, out_bytes),
            TPCollective("backward", A2A, in_bytes)]


def ep_layer_collectives(tokens: int, hidden: int, top_k: int, num_experts: int, e: int,
                         capacity_factor: float | None = None, elem_bytes: int = 4) -> list[TPCollective]:
    """:func:`ep_collectives` under balanced routing (A = R = :func:`ep_rows`)."""
    _check(num_experts, e, top_k, capacity_factor)
    rows = ep_rows(tokens, num_experts, top_k, capacity_factor)
    return ep_collectives(rows, rows, hidden, num_experts, e, elem_bytes)


def ep_bytes_per_rank(tokens: int, hidden: int, top_k: int, num_experts: int, e: int,
                      capacity_factor: float | None = None, elem_bytes: int = 4) -> dict[str, float]:
    """Balanced routing, per rank per layer: payload bytes of each exchange (counts, dispatch and
    combine, forward and backward), their ``total``, and ``wire``, the (e−1)/e that leaves the rank."""
    c = ep_layer_collectives(tokens, hidden, top_k, num_experts, e, capacity_factor, elem_bytes)
    names = ["counts", "dispatch_forward", "combine_forward", "combine_backward", "dispatch_backward"]
    out = {n: float(x.nbytes) for n, x in zip(names, c)} if c else dict.fromkeys(names, 0.0)
    out["total"] = sum(out.values())
    out["wire"] = out["total"] * (e - 1) / e
    return out


def rank_loads(tokens_per_expert: list[int], e: int) -> list[int]:
    """Rows each EP rank's experts receive: the sums of contiguous blocks of E/e experts."""
    _check(len(tokens_per_expert), e)
    local = len(tokens_per_expert) // e
    return [sum(tokens_per_expert[r * local:(r + 1) * local]) for r in range(e)]


def expert_load_imbalance(tokens_per_expert: list[int], e: int) -> float:
    """Most-loaded EP rank over the mean (1.0: balanced; e: every row on one rank)."""
    loads = rank_loads(tokens_per_expert, e)
    return imbalance(loads) if sum(loads) else 1.0


def ep_comm_time(tokens: int, hidden: int, top_k: int, num_experts: int, e: int, link: Link,
                 capacity_factor: float | None = None, elem_bytes: int = 2) -> float:
    """α-β seconds of one layer's EP exchanges (forward and backward), balanced routing: each
    all-to-all is e−1 messages carrying (e−1)/e of its payload."""
    if e == 1:
        return 0.0
    return sum((e - 1) * link.alpha + (e - 1) / e * c.nbytes * link.beta
               for c in ep_layer_collectives(tokens, hidden, top_k, num_experts, e, capacity_factor, elem_bytes))


def moe_layer_flops(tokens: int, hidden: int, ffn: int, top_k: int, num_experts: int, matrices: int = 2) -> float:
    """FLOPs of a MoE MLP (forward and backward, 3 × 2 per multiply-add): the router (E·h per
    token) and k experts of ``matrices`` h×ffn matrices per token (2 for a GELU MLP, 3 for SwiGLU)."""
    return 6 * tokens * hidden * (num_experts + top_k * matrices * ffn)


def moe_activation_bytes(tokens: int, hidden: int, ffn: int, top_k: int, t: int = 1, sequence_parallel: bool = False,
                         matrices: int = 2) -> float:
    """Activation bytes a MoE MLP saves beyond the dense 4h MLP of Korthikanti et al. 2022 (16-bit,
    per layer and rank): each token's row is saved as the input of k experts (2h bytes each, /t
    under SP) and each expert's inner activations, 4(m−1)·ffn bytes (m = 2, GELU: its input
    and output; m = 3, SwiGLU: gate, up, their activation and product), split over TP; the dense
    MLP's 2h + 16h are taken off. Negative when the experts are narrower than 4h and k = 1."""
    row = 2 * hidden / (t if sequence_parallel else 1)
    inner = 4 * (matrices - 1) * ffn / t
    return tokens * (top_k * (row + inner) - (row + 16 * hidden / t))
