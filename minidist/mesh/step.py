"""One training step over DP × PP × TP: the three techniques of the course on one mesh.

Narayanan et al. 2021 (Megatron-LM, PTD-P), Sec. 3. A step on the global batch B:

1. DP: data-parallel rank i takes rows [i·B/d, (i+1)·B/d) (``minidist.models.local_slice``);
2. PP: the pipeline executor (:func:`minidist.pipeline.run_schedule`) cuts them into m
   micro-batches and runs the schedule (GPipe, 1F1B, ...) over the PP group, each
   micro-batch loss scaled by 1/m so the accumulated gradient is the local batch's;
3. TP: inside every stage, Megatron's f and g all-reduce over the TP group (or SP's
   gathers and scatters), and under SP one all-reduce sums the LayerNorms' partial grads;
4. DP again: one all-reduce of the stage's gradients, flattened into one buffer, over
   the DP group, divided by d: the mean over the global batch, as one process has it;
5. the optimizer steps on the rank's shard (Adam and SGD are elementwise, so a shard's
   update is the full update's rows).

The loss reaches every rank through two one-number all-reduces (PP: only the last stage
holds it; DP: the mean of the d local means). Every size is checked by
:func:`check_3d` before any rank communicates.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from minidist.mesh.grid import check_layout, coordinate, make_mesh
from minidist.mesh.stage import GPTStage, stage_layers
from minidist.models import GPTConfig, local_slice, make_optimizer
from minidist.pipeline import make, run_schedule

LOSS_DTYPE = torch.float64      # the one-number loss report (8 bytes per all-reduce)


def check_3d(cfg: GPTConfig, world_size: int, dp: int, pp: int, tp: int, *, batch: int, micro_batches: int,
             schedule: str = "1f1b", sequence_parallel: bool = False) -> None:
    """``ValueError`` for any size the 3D step cannot take, naming the rule broken."""
    check_layout(world_size, dp, pp, tp)
    stage_layers(cfg.n_layers, pp, 0)
    if cfg.n_heads % tp:
        raise ValueError(f"n_heads={cfg.n_heads} is not divisible by tp={tp}: TP splits whole heads")
    if cfg.d_ff % tp or cfg.vocab % tp:
        raise ValueError(f"d_ff={cfg.d_ff} and vocab={cfg.vocab} must be divisible by tp={tp} "
                         "(column-parallel MLP and LM head)")
    if sequence_parallel and cfg.seq_len % tp:
        raise ValueError(f"seq_len={cfg.seq_len} is not divisible by tp={tp} (sequence parallelism)")
    if cfg.dropout:
        raise ValueError("the 3D step is checked against one process: use dropout=0")
    if batch % (dp * micro_batches):
        raise ValueError(f"a global batch of {batch} does not split into dp={dp} slices of "
                         f"m={micro_batches} equal micro-batches")
    make(schedule, pp, micro_batches)       # the schedule's own rules (e.g. interleaved: m % p)


class Trainer3D:
    """This rank's part of a DP × PP × TP TinyGPT, built from the full single-process model.

    ``mesh``: torch's DeviceMesh with dims "dp", "pp", "tp" (made here when not given).
    ``step(ids, targets)`` takes the *global* batch (identical on every rank) and returns
    the global mean loss, on every rank."""

    def __init__(self, model: nn.Module, dp: int, pp: int, tp: int, *, batch: int, micro_batches: int,
                 schedule: str = "1f1b", sequence_parallel: bool = False, optimizer: str = "adam",
                 lr: float = 1e-2, mesh=None):
        world = dist.get_world_size()
        check_3d(model.cfg, world, dp, pp, tp, batch=batch, micro_batches=micro_batches, schedule=schedule,
                 sequence_parallel=sequence_parallel)
        self.cfg, self.dp, self.pp, self.tp = model.cfg, dp, pp, tp
        self.batch, self.m, self.schedule_name = batch, micro_batches, schedule
        self.mesh = mesh if mesh is not None else make_mesh(dp, pp, tp)
        self.dp_group, self.pp_group, self.tp_group = (self.mesh.get_group(a) for a in ("dp", "pp", "tp"))
        self.i_dp, self.i_pp, self.i_tp = coordinate(dist.get_rank(), dp, pp, tp)
        self.stage = GPTStage(model, self.i_pp, pp, self.tp_group, sequence_parallel=sequence_parallel)
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, optimizer, lr)
        self.schedule = make(schedule, pp, micro_batches)
        self.last_stats = None

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        ids, targets = local_slice(ids, self.i_dp, self.dp), local_slice(targets, self.i_dp, self.dp)
        shape = self.stage.activation_shape(ids.shape[0] // self.m, ids.shape[1])
        self.optimizer.zero_grad(set_to_none=True)
        self.last_stats = run_schedule(self.schedule, [self.stage], ids if self.stage.first else None,
                                       targets if self.stage.last else None, self.stage.loss,
                                       act_shape=shape, group=self.pp_group, dtype=self.params[0].dtype)
        self.stage.sync_grads()
        self.reduce_gradients()
        self.optimizer.step()
        return self.report_loss(self.last_stats.loss)

    def reduce_gradients(self) -> None:
        """DP: one all-reduce of all this stage's gradients, then / d (the global mean)."""
        if self.dp == 1:
            return
        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def report_loss(self, local: float | None) -> float:
        """The global mean loss on every rank: the last stage's over PP, the mean over DP."""
        loss = torch.tensor([local if local is not None else 0.0], dtype=LOSS_DTYPE, device=self.params[0].device)
        if self.pp > 1:
            dist.all_reduce(loss, group=self.pp_group)      # only the last stage adds a non-zero
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        return float(loss)
