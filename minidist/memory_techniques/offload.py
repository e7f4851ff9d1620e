"""Optimizer-state offload: fp32 masters and Adam moments in host memory, stepped by the CPU.

Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC),
Sec. 4. Of mixed precision's 2 + 2 + 12 bytes per parameter (:mod:`.mixed_precision`), the
K = 12 of the optimizer are touched once per step by an elementwise update: the cheapest
work of the step and the biggest share of its memory. ZeRO-Offload moves them, and the
update, to the host, whose memory is larger and cheaper; the device keeps the 16-bit
weights and gradients (4 bytes per parameter). Per step, over the host link (PCIe):

    down  the 16-bit gradients      2Ψ bytes
    up    the 16-bit weights        2Ψ bytes (rounded on the host, then copied up)

(the paper's offload strategy: the fewest bytes across the link that still leave every
O(Ψ)-per-step computation where its data is). With a loss scaler the overflow check runs
on the device before anything moves (one all-reduce of a flag over the scaler's group), so
a skipped step moves nothing. On a CPU-only machine host and device are the same memory:
:meth:`OffloadOptimizer.device_bytes` and :meth:`~OffloadOptimizer.host_bytes` still
separate the two sets of storages; on a GPU node the device's allocator sees only the 4Ψ.
Formulas: :func:`minidist.cost.offload_traffic_bytes`, :func:`minidist.cost.offload_memory_bytes`.

API:
    opt = OffloadOptimizer(model16.parameters(), host="cpu", scaler=None, lr=...)   # Adam by default
    (scaler.scale(loss) if scaler else loss).backward(); stepped = opt.step(); opt.zero_grad()
    opt.traffic          # {"down", "up"}: bytes moved by the last step; opt.total_traffic: since the start
"""
from __future__ import annotations

import torch

from minidist.memory import optimizer_state_tensors, storage_bytes
from minidist.memory_techniques.loss_scaler import DynamicLossScaler
from minidist.memory_techniques.mixed_precision import LOW_PRECISION

__all__ = ["OffloadOptimizer"]


class OffloadOptimizer(torch.optim.Optimizer):
    """Adam (``inner_optimizer``) on fp32 masters kept on ``host``, for 16-bit ``params`` on a device."""

    def __init__(self, params, host: torch.device | str = "cpu", inner_optimizer=torch.optim.Adam,
                 scaler: DynamicLossScaler | None = None, **optimizer_kwargs):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("OffloadOptimizer needs at least one parameter with requires_grad=True")
        for p in params:
            if p.dtype not in LOW_PRECISION:
                raise ValueError(f"offload keeps the 16-bit weights on the device; got a {p.dtype} parameter "
                                 "(minidist.memory_techniques.to_low_precision)")
        super().__init__(params, {})
        self.params, self.host, self.scaler = params, torch.device(host), scaler
        self.masters = [p.detach().to(device=self.host, dtype=torch.float32, copy=True).requires_grad_(True)
                        for p in params]
        self.inner = inner_optimizer(self.masters, **optimizer_kwargs)
        self.traffic = {"down": 0, "up": 0}
        self.total_traffic = {"down": 0, "up": 0}
        self.last_step_taken = True

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Check for overflow on the device; move the 16-bit gradients down, unscale them in fp32,
        step on the host, round the masters to 16 bits and move them up. Drops the gradients.
        Returns whether the step was taken."""
        if closure is not None:
            raise ValueError("OffloadOptimizer.step takes no closure")
        self.traffic = {"down": 0, "up": 0}
        scale, found_inf = 1.0, False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            found_inf = self.scaler.found_inf(self.params)
            self.scaler.update(found_inf)
        if not found_inf:
            for p, m in zip(self.params, self.masters):
                if p.grad is None:
                    m.grad = None
                    continue
                down = p.grad.to(self.host)                     # 16-bit across the link
                self.traffic["down"] += down.numel() * down.element_size()
                m.grad = down.to(torch.float32).mul_(1.0 / scale)
            self.inner.step()
            for p, m in zip(self.params, self.masters):
                up = m.detach().to(p.dtype)                     # rounded on the host
                p.copy_(up)                                     # 16-bit across the link
                self.traffic["up"] += up.numel() * up.element_size()
                m.grad = None
        for p in self.params:
            p.grad = None
        for k in self.traffic:
            self.total_traffic[k] += self.traffic[k]
        self.last_step_taken = not found_inf
        return self.last_step_taken

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def device_bytes(self) -> dict[str, int]:
        """Storages held for the model on its device: {"params", "grads", "total"} (4Ψ in 16 bits)."""
        seen: set = set()
        out = {"params": storage_bytes(self.params, seen),
               "grads": storage_bytes([p.grad for p in self.params if p.grad is not None], seen)}
        out["total"] = out["params"] + out["grads"]
        return out

    def host_bytes(self) -> int:
        """Storages of the fp32 masters and the optimizer's moments on the host (12Ψ with Adam)."""
        return storage_bytes(self.masters + optimizer_state_tensors(self.inner))
