"""Mixed-precision training: 16-bit weights and gradients, fp32 master weights and Adam moments.

Micikevicius et al. 2018, "Mixed Precision Training" (ICLR), Sec. 3.1. Forward and backward
run in fp16 or bf16 (half the bytes, tensor-core speed on a GPU), but the *update* cannot:
with lr·g a thousand times smaller than w, w + lr·g rounds back to w in a 10-bit (fp16) or
7-bit (bf16) mantissa and training stalls. So the optimizer keeps an fp32 **master copy**
of every weight and steps that; the 16-bit weights are a copy of it, refreshed after each
step (the *copy-back*). Per parameter, with Adam (Rajbhandari et al. 2019, ZeRO, Sec. 3.1):

    2 (16-bit weight) + 2 (16-bit gradient) + 12 (fp32 master 4 + momentum 4 + variance 4) = 16 bytes

K = 12 is the optimizer's share: what ZeRO shards first (:mod:`.zero_precision`). The fp32
gradient of the master exists only inside the step (made from the 16-bit one, then freed).
Formulas: :func:`minidist.cost.mixed_precision_bytes_per_param`.

API (lab 8 reimplements ``mixed_precision_step``):
    model = to_low_precision(TinyGPT(...), torch.bfloat16)   # 16-bit weights, in place
    masters = make_master_params(model)                       # fp32 copies, leaves
    opt = torch.optim.Adam(masters, lr=...)                   # fp32 moments
    (scaler.scale(loss) if scaler else loss).backward()
    stepped = mixed_precision_step(model, masters, opt, scaler)   # False: skipped (overflow)
    state_bytes(model.parameters(), masters, opt)             # {"params", "grads", "optimizer", "total"}

:class:`MixedPrecisionOptimizer` is the same step as an optimizer over given 16-bit tensors,
so the ZeRO wrappers of :mod:`minidist.data_parallel` can own it for their shards.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minidist.memory import optimizer_state_tensors, storage_bytes
from minidist.memory_techniques.loss_scaler import DynamicLossScaler

__all__ = ["LOW_PRECISION", "to_low_precision", "make_master_params", "master_step", "mixed_precision_step",
           "MixedPrecisionOptimizer", "state_bytes"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_dtype(dtype) -> None:
    if dtype not in LOW_PRECISION:
        raise ValueError(f"mixed precision trains in torch.float16 or torch.bfloat16, got {dtype!r}")


def to_low_precision(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Cast the model's floating-point parameters and buffers to ``dtype`` in place (a bool
    mask stays bool) and return it."""
    _check_dtype(dtype)
    return model.to(dtype)


def make_master_params(model_or_params) -> list[torch.Tensor]:
    """fp32 copies of the trainable parameters (a module's, or the given tensors), on their
    device: leaves the optimizer steps instead of the 16-bit weights."""
    params = _trainable(model_or_params)
    return [p.detach().to(dtype=torch.float32, copy=True).requires_grad_(True) for p in params]


def _trainable(model_or_params) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return [p for p in model_or_params.parameters() if p.requires_grad]
    return list(model_or_params)


@torch.no_grad()
def master_step(params, master_params, optimizer: torch.optim.Optimizer,
                scaler: DynamicLossScaler | None = None) -> bool:
    """One step of the fp32 ``master_params`` from the 16-bit ``params``' gradients.

    1. master.grad = fp32(p.grad), and p.grad is dropped (the 16-bit gradient is spent);
    2. with a ``scaler``: unscale the fp32 gradients, agree on overflow across its group,
       update the scale; on overflow skip the step (the gradients are dropped);
    3. ``optimizer.step()`` on the masters, and the copy-back p ← 16-bit(master).
    Returns whether the step was taken. A parameter without gradient gets none (Adam skips it).
    """
    params, master_params = list(params), list(master_params)
    if len(params) != len(master_params):
        raise ValueError(f"{len(params)} parameters but {len(master_params)} master parameters")
    for p, m in zip(params, master_params):
        if p.shape != m.shape or m.dtype != torch.float32:
            raise ValueError(f"master parameter {tuple(m.shape)} {m.dtype} does not match {tuple(p.shape)}: "
                             "masters are fp32 copies, one per parameter (make_master_params)")
    for p, m in zip(params, master_params):
        m.grad = None if p.grad is None else p.grad.to(torch.float32)
        p.grad = None
    found_inf = False
    if scaler is not None:
        found_inf = scaler.unscale_(master_params)
        scaler.update(found_inf)
    if not found_inf:
        optimizer.step()
        for p, m in zip(params, master_params):
            p.copy_(m)                      # the copy-back: round the fp32 master to 16 bits
    for m in master_params:
        m.grad = None
    return not found_inf


def mixed_precision_step(model: nn.Module, master_params, optimizer: torch.optim.Optimizer,
                         scaler: DynamicLossScaler | None = None) -> bool:
    """:func:`master_step` for a module's trainable parameters (``scaler`` optional for bf16;
    fp16 needs one). Returns False when the step was skipped for an overflow."""
    return master_step(_trainable(model), master_params, optimizer, scaler)


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """An optimizer over 16-bit tensors that steps fp32 masters of them (:func:`master_step`).

    ``MixedPrecisionOptimizer(params, inner_optimizer=torch.optim.Adam, scaler=None, **kwargs)``:
    the masters and ``inner_optimizer(masters, **kwargs)`` are made here, on the tensors' device.
    This is what the ZeRO wrappers own when they are given it as ``optimizer_cls`` (they hand
    it only their shards: the masters and moments are then sharded too). ``last_step_taken``
    says whether the last :meth:`step` updated anything.
    """

    def __init__(self, params, inner_optimizer=torch.optim.Adam, scaler: DynamicLossScaler | None = None,
                 **optimizer_kwargs):
        params = list(params)
        for p in params:
            _check_dtype(p.dtype)
        super().__init__(params, {})
        self.params = params
        self.masters = make_master_params(params)
        self.inner = inner_optimizer(self.masters, **optimizer_kwargs)
        self.scaler, self.last_step_taken = scaler, True

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MixedPrecisionOptimizer.step takes no closure")
        self.last_step_taken = master_step(self.params, self.masters, self.inner, self.scaler)
        return self.last_step_taken

    def state_tensors(self) -> list[torch.Tensor]:
        """The fp32 masters and the inner optimizer's state: the K bytes per parameter."""
        return self.masters + optimizer_state_tensors(self.inner)


def state_bytes(params, master_params, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Storage bytes a rank holds now: {"params" (16-bit), "grads" (16-bit and any fp32 master
    gradient), "optimizer" (fp32 masters + moments: the K), "total"}; each storage counted once."""
    params, master_params = list(params), list(master_params)
    seen: set = set()
    out = {"params": storage_bytes(params, seen),
           "grads": storage_bytes([p.grad for p in params + master_params if p.grad is not None], seen),
           "optimizer": storage_bytes(master_params + optimizer_state_tensors(optimizer), seen)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
