"""Dynamic loss scaling: keep fp16 gradients inside fp16's range.

Micikevicius et al. 2018, "Mixed Precision Training" (ICLR), Sec. 3.2. fp16 has 5 exponent
bits: its smallest normal number is 2⁻¹⁴ ≈ 6.1e-5 (subnormals reach 2⁻²⁴ ≈ 6e-8) and its
largest 65504. Many gradients of a deep network are smaller than that and flush to zero.
Multiplying the loss by S before backward multiplies every gradient by S (the chain rule is
linear), shifting them into range; dividing by S before the update undoes it (in fp32, on the
master weights). Too large an S overflows instead: a gradient becomes inf or nan.

*Dynamic* scaling finds S by trial (the paper's "backoff" and NVIDIA's AMP):

* a step whose gradients hold an inf or nan is **skipped** (no update, the gradients
  dropped) and S ← S·backoff_factor (½);
* after ``growth_interval`` clean steps in a row, S ← S·growth_factor (2).

With data parallelism (and ZeRO, where each rank sees only its shard of the gradient) one
rank may overflow while the others do not; if only that rank skipped, the replicas would
diverge. :meth:`DynamicLossScaler.unscale_` therefore agrees on ``found_inf`` with **one**
all-reduce (MAX of a 0/1 flag) over ``group`` before anyone decides.

bf16 has fp32's 8 exponent bits: its range is fp32's, so it needs no scaler (only its
7-bit mantissa is short, which the fp32 master weights of :mod:`.mixed_precision` handle).

API (used by lab 8 and deck 08):
    scaler = DynamicLossScaler(init_scale=2.**16, growth_factor=2., backoff_factor=.5,
                               growth_interval=2000, group=None)
    scaler.scale(loss).backward()
    found_inf = scaler.unscale_(params)   # grads /= S in place; True on every rank if any rank overflowed
    scaler.found_inf(params)              # the same check without unscaling (offload checks on the device)
    scaler.update(found_inf)              # backoff or growth; scaler.history: S before each update
    scaler.state_dict() / scaler.load_state_dict(state)   # plain JSON: a checkpoint's extra
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.runtime.device import device as rank_device

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Loss scale S with skip-and-backoff on overflow and growth after clean steps.

    ``group``: the ranks that must agree on skipping (the data-parallel group; ``None`` is
    the whole world; a process without torch.distributed, or a group of one, agrees
    with itself and communicates nothing). ``history`` lists (scale used, found_inf) per
    :meth:`update`, for plotting S over steps; ``skipped`` counts skipped steps.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.group = growth_interval, group
        self.clean_steps = 0                 # consecutive steps without overflow
        self.skipped = 0
        self.history: list[tuple[float, bool]] = []

    # -- before backward ---------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss · S (a new tensor; backward through it gives gradients × S)."""
        return loss * self.scale_value

    # -- after backward ----------------------------------------------------------------
    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide every ``p.grad`` by S in place; return whether any rank of the group found an
        inf or nan in its gradients (one all-reduce of one flag, the same answer on every rank).

        Unscale the fp32 master gradients, not the fp16 ones: 1/S would flush the small
        fp16 values to zero, the very thing scaling prevents."""
        params = list(params)
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)          # inf·(1/S) stays inf, nan stays nan
        return self.found_inf(params)

    @torch.no_grad()
    def found_inf(self, params) -> bool:
        """Whether any rank of the group holds an inf or nan in the gradients of ``params``: a
        0/1 flag on the gradients' device, one all-reduce (MAX) over the group. (Scaled or not:
        dividing by S makes no inf.)"""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else rank_device()   # a rank without gradients still joins
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            flag += (~torch.isfinite(g)).any().to(flag.dtype)
        if _communicates(self.group):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Skip → S·backoff and the clean-step count restarts; ``growth_interval`` clean steps → S·growth."""
        self.history.append((self.scale_value, bool(found_inf)))
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.clean_steps = 0

    def get_scale(self) -> float:
        return self.scale_value

    def state_dict(self) -> dict:
        """Plain JSON (a checkpoint's ``extra``): the scale, the clean steps since the last change of
        it, the skipped steps, and the policy (``growth_factor``, ``backoff_factor``, ``growth_interval``)."""
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "skipped": self.skipped,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s): the same scale and clean-step count, so the
        next growth or backoff comes when it would have. A state saved under another policy is a
        ValueError (as :class:`minidist.checkpoint.sampler.ResumableSampler` refuses another data
        order). ``history`` is this process's own record and starts empty."""
        if not isinstance(state, dict) or not {"scale", "clean_steps", "skipped"} <= state.keys():
            raise ValueError(f"a loss scaler's state has 'scale', 'clean_steps' and 'skipped', got {state!r}")
        for k in ("growth_factor", "backoff_factor", "growth_interval"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"the saved loss scaler has {k}={state[k]!r}, this one {getattr(self, k)!r}: "
                                 "another scaling policy cannot be resumed")
        scale, clean, skipped = state["scale"], state["clean_steps"], state["skipped"]
        if not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"a loss scale must be a number > 0, got {scale!r}")
        if not (isinstance(clean, int) and 0 <= clean < self.growth_interval and isinstance(skipped, int)
                and skipped >= 0):
            raise ValueError(f"clean_steps must be an int in [0, {self.growth_interval}) and skipped an int >= 0, "
                             f"got {clean!r} and {skipped!r}")
        self.scale_value, self.clean_steps, self.skipped = float(scale), clean, skipped


def _communicates(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
