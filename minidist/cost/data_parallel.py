"""Cost of data parallelism: bytes on the wire per step, and model-state memory per rank.

Wire bytes. The tracer records a collective's *payload* (the input handed to the
backend: the full vector for all_reduce and reduce_scatter_tensor, the shard for
all_gather_into_tensor), not the backend's own traffic. :func:`ring_wire_bytes` turns
a payload into what a rank sends with the bandwidth-optimal ring, which is what the
lecture's 2(N−1)/N·Ψ refers to; point-to-point sends count as sent.

Memory: Rajbhandari et al. 2019 (ZeRO), Fig. 1 / Sec. 5, below.
"""
from __future__ import annotations


# ============================================================================= wire bytes
def ring_wire_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a traced op of ``payload`` bytes (ring algorithms)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload
    if op in ("reduce_scatter_tensor", "reduce_scatter", "all_to_all_single"):
        return (n - 1) / n * payload      # payload = full input; each rank sends N−1 chunks, keeps one
    if op in ("all_gather_into_tensor", "all_gather"):
        return (n - 1) * payload          # payload = own shard, forwarded N−1 times
    if op in ("send", "isend"):
        return payload
    if op in ("recv", "irecv", "barrier"):
        return 0
    raise ValueError(f"no wire model for {op!r}")


def theory_wire_bytes(variant: str, numel: int, n: int) -> float:
    """Bytes the busiest rank sends per step, from the lecture: 2(N−1)/N·Ψ for DDP and
    ZeRO-1/2, 3(N−1)/N·Ψ for ZeRO-3, (N−1)·Ψ for the parameter server (fp32 elements)."""
    psi = 4 * numel
    if variant == "parameter_server":
        return (n - 1) * psi
    return (3 if variant == "zero3" else 2) * (n - 1) / n * psi


# ============================================================================= ZeRO memory
# Rajbhandari et al. 2019 (ZeRO), Fig. 1 / Sec. 5: bytes of *model states* per rank for
# Ψ trainable parameters on N data-parallel ranks. Mixed-precision Adam (the lecture's
# form) keeps fp16 parameters (2Ψ), fp16 gradients (2Ψ) and K = 12 bytes per parameter of
# optimizer state (fp32 master copy, momentum, variance):
#     DDP  (2+2+K)Ψ      ZeRO-1  (2+2+K/N)Ψ      ZeRO-2  (2+(2+K)/N)Ψ      ZeRO-3  (2+2+K)Ψ/N
# The CPU labs train in plain fp32 with no master copy: 4 + 4 + K=8 (momentum, variance),
# i.e. 16Ψ for DDP. ``minidist.memory`` measures the same three categories from live
# tensors, and the tests hold the measurement to within 2% of these numbers.
MIXED_PRECISION_ADAM = {"param_bytes": 2, "grad_bytes": 2, "k": 12}
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "k": 8}


def zero_memory_bytes(stage: int, numel: float, n: int, param_bytes: float = 2, grad_bytes: float = 2,
                      k: float = 12) -> dict[str, float]:
    """{"params", "grads", "optimizer", "total"} bytes per rank for ZeRO ``stage`` (0 = DDP)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain DDP), 1, 2 or 3, got {stage!r}")
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 and numel >= 0, got n={n}, numel={numel}")
    shard = lambda s: 1 / n if stage >= s else 1.0     # stage s shards the s-th state
    out = {"optimizer": k * numel * shard(1), "grads": grad_bytes * numel * shard(2),
           "params": param_bytes * numel * shard(3)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_memory_bytes_fp32(stage: int, numel: float, n: int) -> dict[str, float]:
    """The form measured on CPU: fp32 parameters and gradients, Adam's two fp32 moments."""
    return zero_memory_bytes(stage, numel, n, **FP32_ADAM)


def zero_bytes_per_param(stage: int, n: int, param_bytes: float = 2, grad_bytes: float = 2,
                         k: float = 12) -> float:
    """Model-state bytes per parameter per rank: 16 for DDP with mixed-precision Adam."""
    return zero_memory_bytes(stage, 1, n, param_bytes, grad_bytes, k)["total"]


def largest_model(budget_bytes: float, stage: int, n: int, **precision) -> float:
    """Parameters whose model states fit a per-rank budget: 80 GB / 16 B = 5e9 for DDP."""
    return budget_bytes / zero_bytes_per_param(stage, n, **precision)
