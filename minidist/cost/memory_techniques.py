"""Cost of the memory techniques: bytes per parameter by precision and ZeRO stage, activation
bytes by recomputation policy, the FLOPs recomputation adds, the traffic offloading adds.

The one source of these formulas: :mod:`minidist.memory_techniques` is measured against them
(``minidist bench memory``, the tests, the tour) and :mod:`minidist.cost.planner` uses them.

**Model states** (Micikevicius et al. 2018; Rajbhandari et al. 2019, ZeRO, Sec. 5), bytes per
parameter per rank on N data-parallel ranks, (weight, gradient, K = optimizer state):

    precision   weight grad  K                     stage 0   1            2              3
    bf16/fp16   2      2     12 (fp32 master, m, v)  16      2 + 2 + 12/N  2 + (2 + 12)/N  16/N
    fp32        4      4      8 (m, v)               16      4 + 4 + 8/N   4 + 12/N        16/N

**Activations** per layer (Korthikanti et al. 2022, Eq. 1-6), 16-bit, per rank:
none sbh(34 + 5as/h) [TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t(34 + 5as/h)]; selective drops
the 5as/h term; full keeps only the layer input, 2sbh [/t under SP]. :func:`activation_terms`
is the same count term by term for this course's blocks as they run (any dtype, LayerNorm
statistics, bool or float dropout masks), which :class:`~minidist.memory.ActivationMeter`
measures to the byte.

**Recomputation FLOPs**: a layer's forward is 2bsh(4h + 2 d_ff)/t + 4bs²h/t (QKV and the
output projection, the MLP, QKᵀ and the attention-weighted V; 24bsh² + 4bs²h at d_ff = 4h).
Full recomputation repeats it all; selective only the 4bs²h/t of attention's core.

**Offload** (Ren et al. 2021, ZeRO-Offload): fp32 masters and moments (12 bytes per parameter)
live in host memory; per step the 16-bit gradients go down (2Ψ) and the 16-bit weights come
up (2Ψ); the device keeps 2 + 2 bytes per parameter.
"""
from __future__ import annotations

from minidist.cost.data_parallel import zero_memory_bytes
from minidist.cost.tensor_parallel import tp_activation_bytes_paper, tp_activation_terms

PRECISIONS = {   # name -> bytes of (weight, gradient, optimizer state K) per parameter, with Adam
    "fp32": {"param_bytes": 4, "grad_bytes": 4, "k": 8},
    "bf16": {"param_bytes": 2, "grad_bytes": 2, "k": 12},
    "fp16": {"param_bytes": 2, "grad_bytes": 2, "k": 12},
}
POLICIES = ("none", "selective", "full")
# the terms selective recomputation drops: attention's scores/softmax/dropout part
RECOMPUTED_BY_SELECTIVE = ("softmax output", "attention dropout mask", "attention dropout output")


def _precision(precision: str) -> dict:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def _policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")


# ============================================================================= model states
def mixed_precision_memory_bytes(precision: str, stage: int, numel: float, n: int = 1) -> dict[str, float]:
    """{"params", "grads", "optimizer", "total"} bytes per rank for ``numel`` parameters."""
    return zero_memory_bytes(stage, numel, n, **_precision(precision))


def mixed_precision_bytes_per_param(precision: str = "bf16", stage: int = 0, n: int = 1) -> float:
    """16 for DDP; 2 + 2 + 12/N, 2 + 14/N, 16/N for ZeRO 1-3 in bf16/fp16."""
    return mixed_precision_memory_bytes(precision, stage, 1, n)["total"]


# ============================================================================= activations
def activation_terms(policy: str, s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                     d_ff: int | None = None, dropout: bool = False, elem_bytes: int = 4, mask_bytes: int = 1,
                     stat_bytes: int | None = None, kv_heads: int | None = None) -> dict[str, float]:
    """Bytes saved per block per rank under ``policy``, by term (the measured count).

    none: :func:`~minidist.cost.tensor_parallel.tp_activation_terms`; selective: the same
    without the softmax output and attention dropout's mask and output, and with K and V kept
    as the projections made them (``kv_heads`` < ``a``, GQA: before their repetition to the
    query heads; a rank holds max(kv_heads/t, 1) of them); full: the block's input only (its
    sequence shard under SP)."""
    _policy(policy)
    if policy == "full":
        return {"block input": elem_bytes * s * b * h / (t if sequence_parallel else 1)}
    terms = tp_activation_terms(s, b, h, a, t, sequence_parallel=sequence_parallel, d_ff=d_ff, dropout=dropout,
                                elem_bytes=elem_bytes, mask_bytes=mask_bytes, stat_bytes=stat_bytes)
    if policy == "selective":
        terms = {k: v for k, v in terms.items() if k not in RECOMPUTED_BY_SELECTIVE}
        kv = elem_bytes * s * b * (h // a) * max((kv_heads or a) / t, 1)        # one of K, V on this rank
        terms["Q, K (for QKᵀ)"] = elem_bytes * s * b * h / t + kv
        terms["V"] = kv
    return terms


def activation_bytes(policy: str, s: int, b: int, h: int, a: int, t: int = 1, **kwargs) -> float:
    """Sum of :func:`activation_terms`."""
    return sum(activation_terms(policy, s, b, h, a, t, **kwargs).values())


def activation_bytes_paper(policy: str, s: int, b: int, h: int, a: int, t: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022's per-layer bytes (16-bit): none sbh(34 + 5as/h) [TP, SP forms],
    selective without the 5as/h term, full 2sbh (/t under SP)."""
    _policy(policy)
    if policy == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    return tp_activation_bytes_paper(s, b, h, a if policy == "none" else 0, t, sequence_parallel)


# ============================================================================= FLOPs
def layer_forward_flops(b: int, s: int, h: int, d_ff: int | None = None, t: int = 1) -> float:
    """Matmul FLOPs of one layer's forward per rank: 2bsh(4h + 2 d_ff)/t + 4bs²h/t."""
    d_ff = 4 * h if d_ff is None else d_ff
    return (2 * b * s * h * (4 * h + 2 * d_ff) + 4 * b * s * s * h) / t


def recompute_flops(policy: str, b: int, s: int, h: int, layers: int = 1, d_ff: int | None = None,
                    t: int = 1) -> float:
    """Extra forward FLOPs per step per rank that ``policy`` spends in backward."""
    _policy(policy)
    if policy == "none":
        return 0.0
    if policy == "selective":
        return layers * 4 * b * s * s * h / t
    return layers * layer_forward_flops(b, s, h, d_ff, t)


# ============================================================================= offload
def offload_traffic_bytes(numel: float, low_bytes: int = 2) -> dict[str, float]:
    """Bytes moved per step by ZeRO-Offload: gradients device → host, weights host → device."""
    return {"down": low_bytes * numel, "up": low_bytes * numel, "total": 2 * low_bytes * numel}


def offload_memory_bytes(numel: float, precision: str = "bf16") -> dict[str, float]:
    """{"device", "host"} bytes of model states: weights and gradients stay, K moves to the host."""
    p = _precision(precision)
    return {"device": (p["param_bytes"] + p["grad_bytes"]) * numel, "host": p["k"] * numel}
