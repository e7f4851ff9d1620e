"""Measurement runs of the 3D step: several DP × PP × TP layouts in one launch, against one process.

Forking 8 ranks costs more than a tiny layout's steps on 2 cores, so every layout of a
run shares one launch: each builds its own mesh (torch's ``init_device_mesh``), trains
``steps`` steps of :class:`minidist.mesh.Trainer3D` with the last step traced, and
returns what the tests, the tour and the bench hold against the model:

* ``losses`` (every rank) next to single-process TinyGPT's (:func:`reference_run`);
* ``weight_err``: max |w - w_ref| over this rank's shard, the reference cut the same way;
* ``traffic``: the traced step's communication by axis, (op, payload bytes) sorted,
  next to :func:`minidist.cost.parallel3d.step_collectives`;
* ``model_states`` (``minidist.memory.model_state_bytes``) and ``activations`` (the
  executor's ``ActivationMeter`` peak) next to :func:`minidist.cost.parallel3d.memory_per_rank`;
* ``groups``: this rank's DP/PP/TP groups as torch's mesh made them.

Everything lives on this rank's device (``minidist.device()``); times go through
``minidist.timed``, which waits for the device's queued work.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minidist.cost.parallel3d import memory_per_rank, step_collectives
from minidist.memory import model_state_bytes
from minidist.mesh import AXES, GPTStage, Trainer3D, coordinate, groups_of
from minidist.models import GPTConfig, TinyGPT, gpt_batch, gpt_loss, make_optimizer
from minidist.runtime import import_optimizers_before_fork, launch, timed
from minidist.trace import trace

import_optimizers_before_fork()      # the ranks it launches build optimizers: they inherit the import

TINY = GPTConfig(vocab=32, d_model=16, n_heads=4, n_layers=4, seq_len=8)


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    schedule: str = "1f1b"
    micro_batches: int = 2
    sequence_parallel: bool = False

    @property
    def name(self) -> str:
        sp = " +SP" if self.sequence_parallel else ""
        return f"{self.dp}x{self.pp}x{self.tp} {self.schedule} m={self.micro_batches}{sp}"


def reference_run(cfg: GPTConfig, steps: int, batch: int, dtype=torch.float32, optimizer: str = "adam",
                  lr: float = 1e-2) -> tuple[list[float], dict]:
    """One process on the full batch: (per-step losses, final state dict)."""
    model = TinyGPT(cfg).to(dtype)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses = []
    for step in range(steps):
        ids, targets = gpt_batch(step, batch, cfg.seq_len, cfg.vocab)
        loss = gpt_loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def axis_of(group: tuple | None, rank: int, layout: Layout) -> str:
    """Which mesh axis a traced event's group is (a group of the whole world: the axis of size n)."""
    n = layout.dp * layout.pp * layout.tp
    ranks = list(group) if group is not None else list(range(n))
    mine = groups_of(rank, layout.dp, layout.pp, layout.tp)
    hits = [a for a in AXES if mine[a] == ranks]
    if not hits:
        raise ValueError(f"rank {rank} communicated in group {ranks}, which is none of its mesh groups {mine}")
    return max(hits, key=lambda a: len(mine[a]))


def _layout_on_rank(cfg, layout: Layout, steps, batch, dtype, optimizer, lr, ref_state) -> dict:
    rank = dist.get_rank()
    with timed() as whole:
        trainer = Trainer3D(TinyGPT(cfg).to(dtype), layout.dp, layout.pp, layout.tp, batch=batch,
                            micro_batches=layout.micro_batches, schedule=layout.schedule,
                            sequence_parallel=layout.sequence_parallel, optimizer=optimizer, lr=lr)
        losses, traffic, step_s = [], {a: [] for a in AXES}, []
        for step in range(steps):
            ids, targets = gpt_batch(step, batch, cfg.seq_len, cfg.vocab)
            dist.barrier()                       # steps timed from a common start
            with timed() as clock, trace() as t:
                losses.append(trainer.step(ids, targets))
            step_s.append(clock.seconds)
    for e in t.comm():
        if e.op != "barrier":
            traffic[axis_of(e.group, rank, layout)].append((e.op, e.nbytes))
    ref = TinyGPT(cfg).to(dtype)
    ref.load_state_dict(ref_state)
    expected = GPTStage(ref, trainer.i_pp, layout.pp, trainer.tp_group, sequence_parallel=layout.sequence_parallel)
    err = max((p - q).abs().max().item() for (n, p), (m, q)
              in zip(trainer.stage.named_parameters(), expected.named_parameters(), strict=True))
    groups = {a: dist.get_process_group_ranks(trainer.mesh.get_group(a)) for a in AXES}
    return {"losses": losses, "weight_err": err, "traffic": {a: sorted(v) for a, v in traffic.items()},
            "model_states": model_state_bytes(trainer.params, trainer.optimizer),
            "activations": trainer.last_stats.peak_activation_bytes, "groups": groups,
            "step_s": step_s, "time_s": whole.seconds}


def layouts_on_rank(layouts, cfg, steps, batch, dtype, optimizer, lr, ref_state) -> list[dict]:
    """Inside a rank: every layout in turn (each with its own mesh)."""
    return [_layout_on_rank(cfg, layout, steps, batch, dtype, optimizer, lr, ref_state) for layout in layouts]


def predict(cfg, layout: Layout, rank: int, batch: int, elem_bytes: int, optimizer: str = "adam") -> dict:
    """The cost model's numbers for ``rank`` of ``layout``: traffic by axis and memory."""
    stage = coordinate(rank, layout.dp, layout.pp, layout.tp)[1]
    kw = dict(batch=batch, micro_batches=layout.micro_batches, sequence_parallel=layout.sequence_parallel,
              elem_bytes=elem_bytes)
    coll = step_collectives(cfg, layout.dp, layout.pp, layout.tp, stage, **kw)
    mem = memory_per_rank(cfg, layout.dp, layout.pp, layout.tp, stage, schedule=layout.schedule,
                          optimizer=optimizer, **kw)
    return {"traffic": {a: sorted((c.op, c.nbytes) for c in coll[a]) for a in AXES}, "memory": mem}


def compare(out: list[list[dict]], layouts, cfg, steps, batch, dtype, optimizer, ref_losses) -> list[dict]:
    """One row per layout: worst errors over ranks, and measured vs predicted bytes."""
    e = dtype.itemsize
    rows = []
    for i, layout in enumerate(layouts):
        per_rank = [o[i] for o in out]
        preds = [predict(cfg, layout, r, batch, e, optimizer) for r in range(len(out))]
        loss_err = max(abs(a - b) for o in per_rank for a, b in zip(o["losses"], ref_losses, strict=True))
        bytes_by_axis = {a: (max(sum(n for _, n in o["traffic"][a]) for o in per_rank),
                             max(sum(n for _, n in p["traffic"][a]) for p in preds)) for a in AXES}
        act_ratio = max(abs(o["activations"] / p["memory"]["activations"] - 1) for o, p in zip(per_rank, preds))
        rows.append({"layout": layout.name, **asdict(layout), "steps": steps,
                     "loss_err": loss_err, "weight_err": max(o["weight_err"] for o in per_rank),
                     "traffic_equal": all(o["traffic"] == p["traffic"] for o, p in zip(per_rank, preds)),
                     "bytes_by_axis": bytes_by_axis,
                     "model_states_equal": all(o["model_states"][k] == p["memory"][k] for o, p in zip(per_rank, preds)
                                               for k in ("params", "grads", "optimizer")),
                     "model_states": [(o["model_states"]["total"], p["memory"]["params"] + p["memory"]["grads"]
                                       + p["memory"]["optimizer"]) for o, p in zip(per_rank, preds)],
                     "activations": [(o["activations"], p["memory"]["activations"]) for o, p in zip(per_rank, preds)],
                     "activation_rel_err": act_ratio,
                     "groups_equal": all(o["groups"] == groups_of(r, layout.dp, layout.pp, layout.tp)
                                         for r, o in enumerate(per_rank)),
                     "step_s": sorted(max(o["step_s"][s] for o in per_rank) for s in range(steps)),
                     "time_s": max(o["time_s"] for o in per_rank)})
    return rows


def run_layouts(layouts, cfg: GPTConfig = TINY, *, steps: int = 2, batch: int = 8, dtype=torch.float32,
                optimizer: str = "adam", lr: float = 1e-2, timeout: float = 120) -> list[dict]:
    """Train every layout (all on the same number of ranks) in one launch; one row each."""
    layouts = list(layouts)
    worlds = {x.dp * x.pp * x.tp for x in layouts}
    if len(worlds) != 1:
        raise ValueError(f"layouts of one run need one world size, got {sorted(worlds)}")
    ref_losses, ref_state = reference_run(cfg, steps, batch, dtype, optimizer, lr)
    out = launch(layouts_on_rank, worlds.pop(), layouts, cfg, steps, batch, dtype, optimizer, lr, ref_state,
                 timeout=timeout)
    return compare(out, layouts, cfg, steps, batch, dtype, optimizer, ref_losses)
