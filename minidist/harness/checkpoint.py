"""Training runs that save, crash, restart and reshard: what the checkpoint tests, tour and lab run.

A *spec* names a layout: ``("ddp",)``, ``("zero", stage)`` with stage 1, 2 or 3 (FSDP) for
:class:`minidist.models.TinyMLP`, ``("ddp", "fp16")`` (DDP of an fp16 TinyMLP: fp32 master
weights and Adam, a :class:`~minidist.memory_techniques.DynamicLossScaler` that overflows and
grows on these data), or ``("3d", dp, pp, tp)`` for :class:`minidist.models.TinyGPT` on
:class:`minidist.mesh.Trainer3D`. Each step draws its global batch from a fixed data set
through :class:`~minidist.checkpoint.sampler.ResumableSampler`, so the data order is part of
the checkpoint and a resumed run takes the same batches as an uninterrupted one.

:func:`train` (inside a rank) resumes from the newest good checkpoint under ``root`` when
there is one (model, optimizer, the loss scaler's state and the sampler's position from
``extra``, and every random state of the rank, :func:`minidist.checkpoint.rng_state`), trains
to ``steps``, saves every ``every`` steps and at the end, and can crash on purpose
(``crash_at``: a rank dies mid-step, or mid-save after writing its file). ``noise > 0`` adds
Gaussian noise to each rank's inputs, drawn from torch's generator of the rank's device (every
generator is seeded per rank), so a resume that lost the random states would diverge. It returns where it started,
so a restarted job can report what was lost. :func:`full_state` loads a checkpoint into one
process (no process group): how runs under different layouts compare.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import checkpoint as ckpt
from minidist.checkpoint.sampler import ResumableSampler
from minidist.data_parallel import BucketedDDP, FullyShardedDataParallel, ZeroDataParallel
from minidist.memory_techniques import DynamicLossScaler, make_master_params, master_step, to_low_precision
from minidist.mesh import Trainer3D
from minidist.models import GPTConfig, TinyGPT, TinyMLP, local_slice, make_optimizer
from minidist.runtime import import_optimizers_before_fork
from minidist.runtime.device import device as rank_device

import_optimizers_before_fork()

# No linear biases: the key bias gets no gradient in exact arithmetic (softmax ignores a constant
# added to every score), so its update is Adam-normalised round-off that differs between layouts.
GPT = GPTConfig(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8, bias=False)
N_EXAMPLES, BATCH, LR = 48, 8, 1e-2
MLP_DIMS = dict(d_in=6, d_out=5)
# fp16's largest number is 65504: the scaled loss (about 1 here) overflows from about 2^16, so
# a scale that starts at 2^17 and grows after every clean step keeps backing off and growing.
FP16_SCALER = dict(init_scale=2.0 ** 17, growth_interval=1)
SEED = 1234         # + rank: each rank's generators


def dataset(spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed data set of a spec's model (CPU; every rank draws the same from the seed)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    if spec[0] == "3d":
        tokens = torch.randint(0, GPT.vocab, (N_EXAMPLES, GPT.seq_len + 1), generator=g, device="cpu")
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return (torch.randn(N_EXAMPLES, MLP_DIMS["d_in"], generator=g, device="cpu"),
            torch.randn(N_EXAMPLES, MLP_DIMS["d_out"], generator=g, device="cpu"))


class Run:
    """One rank's part of a layout: ``step(x, y)``, ``state()`` (its checkpoint pieces)."""

    def __init__(self, spec, group=None, mlp: dict | None = None):
        self.spec, self.rank, self.scaler = spec, dist.get_rank(), None
        kind = spec[0]
        if kind == "3d":
            _, dp, pp, tp = spec
            self.trainer = Trainer3D(TinyGPT(GPT), dp, pp, tp, batch=BATCH, micro_batches=2, lr=LR)
            return
        self.world = dist.get_world_size(group)
        model = TinyMLP(**(mlp or MLP_DIMS))
        if spec == ("ddp", "fp16"):
            self.model = to_low_precision(model, torch.float16)
            self.wrapper, self.masters = BucketedDDP(self.model, group=group), make_master_params(self.model)
            self.optimizer = make_optimizer(self.masters, "adam", LR)
            self.scaler = DynamicLossScaler(**FP16_SCALER, group=group)
        elif kind == "ddp" and len(spec) == 1:
            self.wrapper, self.model = BucketedDDP(model, group=group), model
            self.optimizer = make_optimizer(model.parameters(), "adam", LR)
        elif kind == "zero" and spec[1] in (1, 2):
            self.wrapper = ZeroDataParallel(model, spec[1], torch.optim.Adam, group=group, lr=LR)
        elif kind == "zero" and spec[1] == 3:
            self.wrapper = FullyShardedDataParallel(model, group=group, lr=LR)
        else:
            raise ValueError(f"unknown layout {spec!r}: ('ddp',), ('ddp', 'fp16'), ('zero', 1|2|3) or ('3d', dp, pp, tp)")

    def step(self, x, y, mid=None) -> None:
        """One training step; ``mid()`` runs between backward and the update (Trainer3D: after its step)."""
        mid = mid or (lambda: None)
        if self.spec[0] == "3d":
            self.trainer.step(x, y)
            mid()
            return
        x, y = local_slice(x, self.rank, self.world), local_slice(y, self.rank, self.world)
        if self.scaler is not None:
            x, y = x.to(torch.float16), y.to(torch.float16)
            self.scaler.scale(F.mse_loss(self.wrapper(x), y)).backward()
            mid()
            master_step(self.model.parameters(), self.masters, self.optimizer, self.scaler)
            return
        F.mse_loss(self.wrapper(x), y).backward()
        mid()
        opt = self.optimizer if self.spec[0] == "ddp" else self.wrapper
        opt.step()
        opt.zero_grad()

    def state(self) -> ckpt.State:
        if self.spec[0] == "3d":
            return ckpt.trainer3d(self.trainer)
        if self.spec[0] == "ddp":
            masters = self.masters if self.scaler is not None else None
            return ckpt.replicated(self.model, self.optimizer, owner=self.rank == 0, masters=masters)
        return ckpt.flat_sharded(self.wrapper)


def train(spec, root: str, steps: int, every: int = 2, crash_at: tuple | None = None, crash_marker: str | None = None,
          blocking: bool = True, noise: float = 0.0) -> dict:
    """Inside a rank: resume from ``ckpt.latest(root)`` if any, train to ``steps``, save every ``every``.

    ``crash_at=(rank, step, where)``, ``where`` "step" (dies mid-step: after backward, before the
    update) or "save" (dies with its file written, its record not): fires once, while ``crash_marker``
    (a file) exists, and removes it. ``noise``: the standard deviation of the noise added to the
    inputs. Returns {"start", "resumed_from", "seconds", "restarts"} (``restarts``: torchrun's
    restart count, 0 elsewhere)."""
    t0, device, me = time.perf_counter(), rank_device(), dist.get_rank()
    # Every generator of the rank from SEED + rank (torch's CPU and CUDA ones, Python's, numpy's),
    # not from whatever the launching process held: two runs then hold the same random states.
    torch.manual_seed(SEED + me)
    random.seed(SEED + me)
    np.random.seed(SEED + me)
    run = Run(spec)
    sampler = ResumableSampler(N_EXAMPLES, BATCH, seed=3)
    xs, ys = dataset(spec)
    start, resumed = 0, ckpt.latest(root)
    if resumed is not None:
        extra = ckpt.load(resumed, run.state() + ckpt.rng_state(me))
        start = extra["step"]
        sampler.load_state_dict(extra["sampler"])
        if run.scaler is not None:
            run.scaler.load_state_dict(extra["scaler"])

    def maybe_crash(step, where):
        if crash_at and tuple(crash_at) == (me, step, where) and crash_marker and os.path.exists(crash_marker):
            os.remove(crash_marker)
            os._exit(17)            # no cleanup, no exception: what a killed process does

    pending = None
    for step in range(start, steps):
        idx = sampler.next_batch()
        x, y = xs[idx].to(device), ys[idx].to(device)
        if noise:
            x = x + noise * torch.randn(x.shape, device=device)
        run.step(x, y, mid=lambda s=step: maybe_crash(s, "step"))
        if (step + 1) % every == 0 or step + 1 == steps:
            if pending is not None:
                pending.wait()              # one save in flight at a time
            extra = {"sampler": sampler.state_dict()}
            if run.scaler is not None:
                extra["scaler"] = run.scaler.state_dict()
            saved = ckpt.save(root, run.state() + ckpt.rng_state(me), step + 1, extra=extra,
                              blocking=blocking, fault=lambda at, s=step: maybe_crash(s, "save"))
            pending = None if blocking else saved
    if not blocking and pending is not None:
        pending.wait()
        dist.barrier()                      # the last checkpoint is committed before anyone returns
    return {"start": start, "resumed_from": resumed, "seconds": time.perf_counter() - t0,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}


def full_state(path: str, spec, mlp: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``path`` (model and optimizer) in one process, by name."""
    model = TinyGPT(GPT, device="cpu") if spec[0] == "3d" else TinyMLP(**(mlp or MLP_DIMS), device="cpu")
    masters = None
    if tuple(spec) == ("ddp", "fp16"):      # the fp16 weights, their fp32 masters and the masters' Adam
        masters = make_master_params(to_low_precision(model, torch.float16))
    opt = make_optimizer(masters if masters is not None else model.parameters(), "adam", LR)
    state = ckpt.replicated(model, opt, masters=masters)
    ckpt.load(path, state)
    return {p.key: p.tensor.detach().clone() for p in state.load}


def stall_dims(hidden: int = 1024, n_hidden: int = 6) -> dict:
    """The wider TinyMLP of :func:`save_stall` (about 6 M parameters: 75 MB of model states)."""
    return dict(MLP_DIMS, hidden=hidden, n_hidden=n_hidden)


def save_stall(root: str, blocking: bool, hidden: int = 1024, n_hidden: int = 6, steps: int = 6) -> dict:
    """Inside a rank (ZeRO-3 on a wider TinyMLP): seconds of each training step, the step that
    saves (blocking, or only the host copy when async) counted together with the save call;
    then the seconds ``wait()`` still had to wait for the writer."""
    dims = stall_dims(hidden, n_hidden)
    run, device = Run(("zero", 3), mlp=dims), rank_device()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(BATCH, dims["d_in"], generator=g, device="cpu").to(device)
    y = torch.randn(BATCH, dims["d_out"], generator=g, device="cpu").to(device)
    times, pending, wait_s = [], None, 0.0
    for step in range(steps):
        dist.barrier()
        t = time.perf_counter()
        run.step(x, y)
        if step == 1:
            pending = ckpt.save(root, run.state(), step, blocking=blocking)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    if pending is not None and not blocking:
        pending.wait()
    wait_s = time.perf_counter() - t
    return {"step_s": times, "wait_s": wait_s, "bytes": run.state().bytes_written}
