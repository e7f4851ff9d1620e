"""The reference: PyTorch's own fused collective matmuls, where the machine has them.

``torch.distributed._symmetric_memory`` (torch >= 2.5) registers ``torch.ops.symm_mem.
fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``: the same decomposition as
:mod:`minidist.overlap.ring`, but the chunks move by copies between GPUs' symmetric memory
(one buffer mapped into every GPU of the node) on a side stream, instead of NCCL messages.
They exist only for CUDA tensors (there is no CPU or gloo implementation), so on a CPU rank
:func:`fused_available` says False and why, and the two functions refuse.

They are forward-only (no autograd): references for values and speed, not training layers.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = ["fused_available", "fused_all_gather_matmul", "fused_matmul_reduce_scatter"]


def fused_available(x: torch.Tensor) -> tuple[bool, str]:
    """(whether torch's fused ops can run on ``x``'s device here, the reason when not)."""
    if x.device.type != "cuda":
        return False, f"torch's fused collective matmuls are CUDA-only (symmetric memory); this tensor is on {x.device}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError as err:
        return False, f"this torch has no torch.distributed._symmetric_memory ({err})"
    if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return False, "this torch's symmetric memory has no fused_all_gather_matmul"
    return True, ""


def _group_name(group, x: torch.Tensor) -> str:
    ok, why = fused_available(x)
    if not ok:
        raise RuntimeError(why)
    import torch.distributed._symmetric_memory as symm_mem
    pg = group if group is not None else dist.group.WORLD
    name = pg.group_name
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():         # newer torch enables it by itself and calls this deprecated
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    return name


def fused_all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """``all_gather(x_shard, dim) @ weight.T`` by torch's fused op (forward only, CUDA only)."""
    name = _group_name(group, x_shard)
    _, outs = torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [weight.t()], dim % x_shard.dim(), name)
    return outs[0]


def fused_matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim)`` (sum) by torch's fused op (forward only, CUDA only)."""
    name = _group_name(group, x)
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, weight.t(), "sum", dim % x.dim(), name)
