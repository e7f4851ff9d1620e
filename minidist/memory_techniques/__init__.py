"""Memory beyond sharding: mixed precision, ZeRO's 2 + 2 + 12 bytes, recomputation, offload.

One concept per module, each naming its paper and formula (the formulas themselves are in
:mod:`minidist.cost.memory_techniques`, the measurements in :mod:`minidist.memory`):

* :mod:`.loss_scaler` — :class:`DynamicLossScaler` (Micikevicius et al. 2018): ``scale(loss)``,
  ``unscale_(params) -> found_inf`` agreed across ``group`` with one all-reduce,
  ``update(found_inf)`` (skip → backoff; growth after ``growth_interval`` clean steps), ``history``.
* :mod:`.mixed_precision` — 16-bit weights and gradients, fp32 masters and Adam moments, the
  copy-back: :func:`to_low_precision`, :func:`make_master_params`,
  :func:`mixed_precision_step` ``(model, master_params, optimizer, scaler=None) -> stepped``,
  :class:`MixedPrecisionOptimizer`, :func:`state_bytes`; 2 + 2 + 12 bytes per parameter.
* :mod:`.zero_precision` — :class:`ZeroMixedPrecision` (stage 0-3 over ``group``: 16, 2 + 2 + 12/N,
  2 + 14/N, 16/N bytes per parameter), and the functional ZeRO-1 of lab 8:
  :func:`make_master_shard`, :func:`zero1_mixed_precision_step`.
* :mod:`.recompute` — :func:`recompute_blocks` ``(blocks, x, policy)`` with policy "none",
  "selective" (Korthikanti et al. 2022) or "full" (Chen et al. 2016), for the reference and
  the TP(+SP) GPT; :class:`Recompute`, the autograd.Function that replays the random state.
* :mod:`.offload` — :class:`OffloadOptimizer` (ZeRO-Offload, Ren et al. 2021).
"""
from minidist.memory_techniques.loss_scaler import DynamicLossScaler
from minidist.memory_techniques.mixed_precision import (LOW_PRECISION, MixedPrecisionOptimizer, make_master_params,
                                                        master_step, mixed_precision_step, state_bytes,
                                                        to_low_precision)
from minidist.memory_techniques.offload import OffloadOptimizer
from minidist.memory_techniques.recompute import POLICIES, Recompute, recompute, recompute_blocks
from minidist.memory_techniques.zero_precision import (ZeroMixedPrecision, make_master_shard,
                                                       zero1_mixed_precision_step)

__all__ = ["DynamicLossScaler", "LOW_PRECISION", "MixedPrecisionOptimizer", "make_master_params", "master_step",
           "mixed_precision_step", "state_bytes", "to_low_precision", "OffloadOptimizer", "POLICIES", "Recompute", "recompute",
           "recompute_blocks", "ZeroMixedPrecision", "make_master_shard", "zero1_mixed_precision_step"]
