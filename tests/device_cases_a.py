"""Device-discipline cases of library A (see tests/device_discipline.py): collectives, data parallelism,
pipeline, memory meters, runtime, the MLP models and their harnesses.

Each body runs inside a rank whose default device is ``meta``; inputs are made on ``minidist.device()``,
so anything the library allocates without ``device=`` is a meta tensor and the body fails. Every body
checks its result against a reference (small sizes, fp32): the collectives against sums and concatenations
of every rank's input (each rank can draw all of them), the data-parallel wrappers and harness against
single-process training on the whole batch, the pipeline against one process's autograd, the meters
against byte counts known in advance. Single-process names run on 1 rank, the rest on 2.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minidist
from device_discipline import Case, assert_real
from minidist import collectives as C
from minidist import data_parallel as D
from minidist import memory as M
from minidist import models
from minidist import pipeline as P
from minidist.harness import data_parallel as HD
from minidist.harness import pipeline as HP


def _close(got, want, what="result"):
    assert_real(got)
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _draw(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(minidist.device())


# ----------------------------------------------------------------------------- collectives (2 ranks)
LENGTH = 7        # odd: chunks of unequal size


def _inputs():
    n, r = dist.get_world_size(), dist.get_rank()
    xs = [_draw(100 + q, LENGTH) for q in range(n)]
    return xs, xs[r], r, n


def _all_reduce_case(fn):
    def body():
        xs, x, _, _ = _inputs()
        _close(fn(x), torch.stack(xs).sum(0), fn.__name__)
    return body


def _every_all_reduce():
    xs, x, _, _ = _inputs()
    for name, fn in C.ALL_REDUCES.items():
        _close(fn(x), torch.stack(xs).sum(0), name)


def _broadcast():
    xs, x, _, n = _inputs()
    _close(C.broadcast(x, src=n - 1), xs[n - 1])


def _reduce():
    xs, x, r, _ = _inputs()
    out = C.reduce(x, dst=0)
    assert (out is None) == (r != 0)
    if r == 0:
        _close(out, torch.stack(xs).sum(0))


def _scatter():
    xs, x, r, n = _inputs()
    _close(C.scatter(x, src=0), xs[0].tensor_split(n)[r])


def _gather():
    xs, x, r, _ = _inputs()
    out = C.gather(x, dst=0)
    assert (out is None) == (r != 0)
    if r == 0:
        _close(out, torch.cat(xs))


def _all_gather():
    xs, x, _, _ = _inputs()
    _close(C.all_gather(x), torch.cat(xs))


def _reduce_scatter():
    xs, x, r, n = _inputs()
    _close(C.reduce_scatter(x), torch.stack(xs).sum(0).tensor_split(n)[r])


def _all_to_all():
    xs, x, r, n = _inputs()
    _close(C.all_to_all(x), torch.cat([t.tensor_split(n)[r] for t in xs]))


def _exchange():
    xs, x, r, n = _inputs()
    peer = (r + 1) % n
    got = torch.empty_like(x)
    C.exchange(x, peer, got, peer)
    _close(got, xs[peer])


# ----------------------------------------------------------------------------- data parallelism (2 ranks)
MLP = {"hidden": 9, "tied": True, "unused": True}
STEPS, BATCH, LR = 2, 8, 1e-2


def _reference_params():
    """Single-process training on the whole batch, on this rank's device: what every wrapper must reach."""
    return HD.reference_parameters(MLP, STEPS, BATCH, LR, "sgd")


def _train(make, accumulate=False):
    """``make(model) -> (forward, after_backward, step, zero_grad, full_parameters)``; STEPS steps of SGD
    on this rank's slice (with ``accumulate``, two micro-batches, the first under ``no_sync``)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = models.TinyMLP(**MLP)
    forward, after_backward, step, zero_grad, full = make(model)
    for s in range(STEPS):
        x, y = models.mlp_batch(s, BATCH)
        x, y = models.local_slice(x, rank, n), models.local_slice(y, rank, n)
        if accumulate:
            half = x.shape[0] // 2
            with forward.no_sync():
                (F.mse_loss(forward(x[:half]), y[:half]) / 2).backward()
            (F.mse_loss(forward(x[half:]), y[half:]) / 2).backward()
        else:
            F.mse_loss(forward(x), y).backward()
        after_backward()
        step()
        zero_grad()
    _close(full(), _reference_params(), "parameters after training")


def _sgd(params):
    return models.make_optimizer(params, "sgd", LR)


def _naive_ddp():
    def make(model):
        ddp, opt = D.NaiveDDP(model), _sgd(model.parameters())
        return ddp, ddp.sync_gradients, opt.step, opt.zero_grad, lambda: models.flat_parameters(model)
    _train(make)


def _bucketed_ddp(accumulate=False):
    def make(model):
        ddp, opt = D.BucketedDDP(model, bucket_cap_bytes=256), _sgd(model.parameters())
        assert len(ddp.buckets) > 1
        return ddp, lambda: None, opt.step, opt.zero_grad, lambda: models.flat_parameters(model)
    _train(make, accumulate)


def _parameter_server():
    def make(model):
        ps = D.ParameterServer(model, _sgd)
        return ps, lambda: None, ps.step, ps.zero_grad, lambda: models.flat_parameters(model)
    _train(make)


def _zero(stage):
    def body():
        def make(model):
            z = D.ZeroDataParallel(model, stage, torch.optim.SGD, bucket_cap_bytes=256, lr=LR, momentum=0.9)
            return z, lambda: None, z.step, z.zero_grad, lambda: models.flat_parameters(model)
        _train(make)
    return body


def _fsdp():
    def make(model):
        f = D.FullyShardedDataParallel(model, optimizer_cls=torch.optim.SGD, prefetch=True, lr=LR, momentum=0.9)

        def full():
            with f.summon_full_params():
                return models.flat_parameters(model)
        return f, lambda: None, f.step, f.zero_grad, full
    _train(make)


def _flat_shard():
    r, n = dist.get_rank(), dist.get_world_size()
    tensors = [_draw(1, 2, 3), None, _draw(2, 5)]
    layout = D.FlatShard([(2, 3), (4,), (5,)], n, r)
    flat = layout.flatten(tensors)
    want = torch.cat([tensors[0].reshape(-1), torch.zeros(4, device=minidist.device()), tensors[2],
                      torch.zeros(layout.padded_numel - 15, device=minidist.device())])
    _close(flat, want)
    _close(layout.views(flat)[2], tensors[2])
    _close(layout.my_shard(flat), want.tensor_split(n)[r])


def _make_buckets():
    params = D.trainable_parameters(models.TinyMLP(**MLP))
    buckets = D.make_buckets(params, 256)
    assert sorted(id(p) for b in buckets for p in b) == sorted(id(p) for p in params)
    assert all(sum(p.numel() * p.element_size() for p in b) <= 256 or len(b) == 1 for b in buckets)


def _trainable_parameters():
    model = models.TinyMLP(frozen=True, tied=True)
    params = D.trainable_parameters(model)
    assert_real(*params)
    assert len(params) == len(list(model.parameters())) - 1         # the frozen bias left out, the tie once


# ----------------------------------------------------------------------------- data-parallel harness (2 ranks)
def _harness_params(result):
    _close(result["params"], _reference_params(), "harness parameters")


def _harness_train():
    out = HD.train(HD.library_trainer("bucketed_ddp", "sgd", LR, 256), MLP, STEPS, BATCH, measure=True)
    _harness_params(out)
    assert out["memory"]["params"] >= 4 * out["numel"] and out["traced"]


def _harness_train_variant():
    out = HD.train_variant("zero2", "sgd", LR, 256, model_kwargs=MLP, steps=STEPS, batch=BATCH, peak=True)
    _harness_params(out)
    assert out["peak_step_bytes"] >= out["memory"]["total"] > 0


def _harness_train_cases():
    case = dict(optimizer="sgd", lr=LR, bucket_cap_bytes=256, model_kwargs=MLP, steps=STEPS, batch=BATCH)
    outs = HD.train_cases([case | {"variant": "zero1", "live": True}, case | {"variant": "zero3"}])
    for out in outs:
        _harness_params(out)
    assert outs[0]["live_bytes"] > 0


def _harness_library_trainer():
    make = HD.library_trainer("parameter_server", "sgd", LR)
    _harness_params(HD.train(make, MLP, STEPS, BATCH))


def _harness_reference_parameters():
    got = _reference_params()
    model = models.TinyMLP(**MLP, device="cpu")
    _close(got, models.flat_parameters(models.train_reference(model, STEPS, BATCH, LR, "sgd")))
    assert not torch.equal(got, models.flat_parameters(models.TinyMLP(**MLP)))        # it did train


def _harness_step_time():
    rows = HD._step_time_body(D.BucketedDDP, [64, 1 << 20], {"hidden": 8, "n_hidden": 2}, 2, 8)
    assert [r["buckets"] for r in rows][1] == 1 and rows[0]["buckets"] > 1
    assert all(0 < t < 60 for r in rows for t in r["times"])


# ----------------------------------------------------------------------------- pipeline (2 ranks)
WIDTH, PBATCH = 8, 8


def _pipeline(name, v=1, m=4):
    def body():
        p, rank = dist.get_world_size(), dist.get_rank()
        model = models.block_stack(p * v, WIDTH)
        x, y = models.regression_batch(PBATCH, WIDTH)
        chunks = P.rank_chunks(P.partition(model, p * v), p, rank)
        stats = P.run_schedule(P.make(name, p, m, **({"v": v} if v > 1 else {})), chunks, x, y)
        reference = models.block_stack(p * v, WIDTH)
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        mine = [q for c in chunks for q in c.parameters()]
        theirs = [q for c in P.rank_chunks(P.partition(reference, p * v), p, rank) for q in c.parameters()]
        for a, b in zip(mine, theirs):
            _close(a.grad, b.grad, f"{name} gradient")
        if stats.loss is not None:
            assert math.isclose(stats.loss, loss.item(), rel_tol=1e-5)
        assert stats.peak_activation_bytes > 0
    return body


def _partition():
    model = models.block_stack(4, WIDTH)
    x, _ = models.regression_batch(PBATCH, WIDTH)
    stages = P.partition(model, 2)
    out = x
    for s in stages:
        out = s(out)
    _close(out, model(x))
    out.sum().backward()
    assert_real(*(q.grad for q in model.parameters()))


def _measure_rank():
    """What :func:`minidist.harness.pipeline.measure` runs on each rank (it launches them itself)."""
    t = HP._traced_rank(P.make("1f1b", dist.get_world_size(), 4), P.Costs(F=0.001, B=0.002), WIDTH, PBATCH)
    assert sum(e.op == "span:F" for e in t.events) == 4


def _kept_rank():
    """:func:`minidist.harness.pipeline.kept_at_each_backward` around the library's executor."""
    p, rank = dist.get_world_size(), dist.get_rank()
    chunks = P.rank_chunks(P.partition(models.block_stack(p, WIDTH), p), p, rank)
    x, y = models.regression_batch(PBATCH, WIDTH)
    _, kept = HP.kept_at_each_backward(lambda c: P.run_schedule(P.make("1f1b", p, 4), c, x, y), chunks, [x])
    assert kept == [0, 0, 0, 0], kept


# ----------------------------------------------------------------------------- memory (1 rank)
def _model_state_bytes():
    model = models.TinyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    F.mse_loss(model(models.mlp_batch(0, 4)[0]), models.mlp_batch(0, 4)[1]).backward()
    opt.step()
    numel = sum(p.numel() for p in model.parameters())
    got = M.model_state_bytes(model.parameters(), opt)
    assert got["params"] == got["grads"] == 4 * numel, got
    assert 8 * numel <= got["optimizer"] <= 8 * numel + 8 * len(list(model.parameters())), got
    assert len(M.optimizer_state_tensors(opt)) == 3 * len(list(model.parameters()))


def _storage_bytes():
    t = _draw(0, 10)
    assert M.storage_bytes([t, t[2:5], t.view(2, 5)]) == 40


def _peak_bytes():
    x = _draw(0, 1 << 16)                       # 256 KiB

    def work():
        y = x * 2                               # a temporary of 256 KiB
        return (y + 1).sum()
    result, peak, net = M.peak_bytes(work)
    _close(result, (x * 2 + 1).sum())
    assert peak >= x.nbytes and abs(net) < x.nbytes, (peak, net)


def _live_bytes():
    meter = M.LiveBytes()
    with meter.recording():
        x = _draw(0, 1 << 16)
        with meter.phase("holding"):            # holds x throughout; y only for a while
            y = x + 1
            del y
    assert x.nbytes <= meter.held["holding"] < 2 * x.nbytes, meter.held


def _created_bytes():
    x = _draw(0, 1000)
    with M.CreatedBytes() as made:
        y = x * 2
        y.add_(1)                               # in place: nothing new
        z = (x + 1)[:10]                        # a view keeps its whole storage
    _close(y, x * 2 + 1)
    assert made.bytes == made.peak == 8000 and z.shape == (10,)


def _activation_meter():
    x = _draw(0, 4, 8).requires_grad_()
    meter = M.ActivationMeter()
    with meter.recording():
        y = x.exp()                             # exp saves its output
    assert meter.bytes == y.nbytes and meter.peak_calls == 1
    y.sum().backward()
    _close(x.grad, x.detach().exp())
    assert meter.bytes == 0 and meter.peak_bytes == y.nbytes


def _metered():
    layer = nn.Linear(8, 8, device=minidist.device())
    meter = M.ActivationMeter(exclude=M.model_state(layer))
    stage = M.Metered(layer, meter)
    x = _draw(0, 4, 8).requires_grad_()
    out = stage(x)
    _close(out, layer(x))
    assert meter.bytes == x.nbytes              # the input, saved for the weight gradient; weights excluded
    out.sum().backward()
    _close(x.grad, layer.weight.sum(0).expand(4, 8))


def _model_state():
    layer = nn.BatchNorm1d(3, device=minidist.device())
    state = M.model_state(layer)
    assert_real(*state)
    assert len(state) == 5                      # weight, bias, running mean, running var, batch count


def _saved_activation_bytes():
    x = _draw(0, 16).requires_grad_()
    out, nbytes = M.saved_activation_bytes(torch.tanh, x)
    _close(out, torch.tanh(x.detach()))
    assert nbytes == x.nbytes


# ----------------------------------------------------------------------------- models (1 rank)
def _tiny_mlp():
    model, on_cpu = models.TinyMLP(tied=True), models.TinyMLP(tied=True, device="cpu")
    assert model.hidden[0].weight is model.hidden[-1].weight
    x, y = models.mlp_batch(0, 4)
    F.mse_loss(model(x), y).backward()
    F.mse_loss(on_cpu(x.cpu()), y.cpu()).backward()
    for a, b in zip(model.parameters(), on_cpu.parameters()):
        _close(a, b, "weights: the same on every device")
        _close(a.grad, b.grad, "gradients")


def _mlp_batch():
    x, y = models.mlp_batch(3, 6)
    cx, cy = models.mlp_batch(3, 6, device="cpu")
    _close(x, cx)
    _close(y, cy)
    assert x.device == minidist.device()


def _regression_batch():
    x, y = models.regression_batch(6, 4, step=2)
    cx, cy = models.regression_batch(6, 4, step=2, device="cpu")
    _close(x, cx)
    _close(y, cy)


def _flat_parameters():
    model = models.TinyMLP(tied=True)
    flat = models.flat_parameters(model)
    assert flat.device.type == "cpu" and flat.numel() == sum(p.numel() for p in model.parameters())
    _close(flat[:model.inp.weight.numel()], model.inp.weight.reshape(-1))


def _local_slice():
    x = _draw(0, 8, 2)
    _close(models.local_slice(x, 1, 4), x[2:4])


def _train_reference():
    model = models.train_reference(models.TinyMLP(), 2, 8, LR, "adam")
    on_cpu = models.train_reference(models.TinyMLP(device="cpu"), 2, 8, LR, "adam")
    _close(models.flat_parameters(model), models.flat_parameters(on_cpu))


def _make_optimizer():
    w = nn.Parameter(_draw(0, 3))
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    models.make_optimizer([w], "sgd", 0.5).step()
    _close(w, before - 0.5)


def _residual_block():
    block = models.ResidualMLPBlock(4, 6)
    x = _draw(0, 3, 4).requires_grad_()
    out = block(x)
    _close(out, x + block.fc2(torch.tanh(block.fc1(x))))
    out.sum().backward()
    assert_real(x.grad, block.fc1.weight.grad)


def _block_stack():
    model, on_cpu = models.block_stack(3, 4), models.block_stack(3, 4, device="cpu")
    x, _ = models.regression_batch(2, 4)
    _close(model(x), on_cpu(x.cpu()))
    model(x).sum().backward()
    assert_real(*(q.grad for q in model.parameters()))


# ----------------------------------------------------------------------------- runtime (1 rank)
def _device():
    assert minidist.device() == torch.device("cpu")
    assert torch.empty(1).device.type == "meta", "the test's emulation is off: the default device is not meta"


def _synchronize():
    x = _draw(0, 4)
    minidist.synchronize()
    minidist.synchronize(x.device)


def _timed():
    x = _draw(0, 64, 64)
    with minidist.timed() as t:
        y = x @ x
    _close(y, x @ x)
    assert 0 < t.seconds < 60


CASES = {
    # collectives
    **{f"minidist.collectives.{fn.__name__}": Case(2, _all_reduce_case(fn)) for fn in C.ALL_REDUCES.values()},
    "minidist.collectives.ALL_REDUCES": Case(2, _every_all_reduce),
    "minidist.collectives.broadcast": Case(2, _broadcast),
    "minidist.collectives.reduce": Case(2, _reduce),
    "minidist.collectives.scatter": Case(2, _scatter),
    "minidist.collectives.gather": Case(2, _gather),
    "minidist.collectives.all_gather": Case(2, _all_gather),
    "minidist.collectives.reduce_scatter": Case(2, _reduce_scatter),
    "minidist.collectives.all_to_all": Case(2, _all_to_all),
    "minidist.collectives.exchange": Case(2, _exchange),
    # data parallelism
    "minidist.data_parallel.NaiveDDP": Case(2, _naive_ddp),
    "minidist.data_parallel.BucketedDDP": Case(2, _bucketed_ddp),
    "minidist.data_parallel.GradSyncWrapper": Case(2, lambda: _bucketed_ddp(accumulate=True)),
    "minidist.data_parallel.ParameterServer": Case(2, _parameter_server),
    "minidist.data_parallel.ZeroDataParallel": Case(2, lambda: (_zero(1)(), _zero(2)())),
    "minidist.data_parallel.FullyShardedDataParallel": Case(2, _fsdp),
    "minidist.data_parallel.FlatShard": Case(2, _flat_shard),
    "minidist.data_parallel.make_buckets": Case(1, _make_buckets),
    "minidist.data_parallel.trainable_parameters": Case(1, _trainable_parameters),
    # data-parallel harness
    "minidist.harness.data_parallel.train": Case(2, _harness_train),
    "minidist.harness.data_parallel.train_variant": Case(2, _harness_train_variant),
    "minidist.harness.data_parallel.train_cases": Case(2, _harness_train_cases),
    "minidist.harness.data_parallel.library_trainer": Case(2, _harness_library_trainer),
    "minidist.harness.data_parallel.reference_parameters": Case(1, _harness_reference_parameters),
    "minidist.harness.data_parallel.step_time_vs_bucket_size": Case(2, _harness_step_time),
    # pipeline
    "minidist.pipeline.run_schedule": Case(2, lambda: (_pipeline("1f1b")(), _pipeline("zb-h1")(),
                                                       _pipeline("interleaved", v=2)())),
    "minidist.pipeline.partition": Case(1, _partition),
    "minidist.pipeline.rank_chunks": Case(2, _pipeline("gpipe")),
    "minidist.harness.pipeline.measure": Case(2, _measure_rank),
    "minidist.harness.pipeline.kept_at_each_backward": Case(2, _kept_rank),
    # memory
    "minidist.memory.model_state_bytes": Case(1, _model_state_bytes),
    "minidist.memory.optimizer_state_tensors": Case(1, _model_state_bytes),
    "minidist.memory.storage_bytes": Case(1, _storage_bytes),
    "minidist.memory.peak_bytes": Case(1, _peak_bytes),
    "minidist.memory.LiveBytes": Case(1, _live_bytes),
    "minidist.memory.CreatedBytes": Case(1, _created_bytes),
    "minidist.memory.ActivationMeter": Case(1, _activation_meter),
    "minidist.memory.Metered": Case(1, _metered),
    "minidist.memory.model_state": Case(1, _model_state),
    "minidist.memory.saved_activation_bytes": Case(1, _saved_activation_bytes),
    # models: the MLP and generic parts (the GPT parts are library B's)
    "minidist.models.TinyMLP": Case(1, _tiny_mlp),
    "minidist.models.mlp_batch": Case(1, _mlp_batch),
    "minidist.models.regression_batch": Case(1, _regression_batch),
    "minidist.models.flat_parameters": Case(1, _flat_parameters),
    "minidist.models.local_slice": Case(1, _local_slice),
    "minidist.models.train_reference": Case(1, _train_reference),
    "minidist.models.make_optimizer": Case(1, _make_optimizer),
    "minidist.models.ResidualMLPBlock": Case(1, _residual_block),
    "minidist.models.block_stack": Case(1, _block_stack),
    # runtime
    "minidist.runtime.device": Case(1, _device),
    "minidist.runtime.synchronize": Case(1, _synchronize),
    "minidist.runtime.timed": Case(1, _timed),
}

_SCHEDULE_DATA = "builds a schedule: lists of actions (pure data, no tensor)"
EXEMPT = {
    "minidist.collectives.group_info": "returns (rank, size) as ints; makes no tensor",
    "minidist.harness.data_parallel.Trainer": "a dataclass of callables (library_trainer's trainers are cased)",
    "minidist.models.describe_mlp": "formats a model's keyword arguments as a string",
    **{f"minidist.pipeline.{n}": _SCHEDULE_DATA for n in ("make", "naive", "gpipe", "one_f_one_b",
                                                          "interleaved_1f1b", "zb_h1", "with_comms")},
    "minidist.pipeline.SCHEDULES": "a constant: schedule names to their generators",
    "minidist.pipeline.Action": "a dataclass: one step of a rank's program",
    "minidist.pipeline.Schedule": "a dataclass: every rank's program",
    "minidist.pipeline.ScheduleError": "an exception class",
    "minidist.pipeline.validate": "checks a schedule's structure and simulates it: pure data, no tensor",
    "minidist.pipeline.check": "validate, raising: pure data, no tensor",
    "minidist.pipeline.Costs": "a dataclass of per-action costs (floats)",
    "minidist.pipeline.Slot": "a dataclass: one timeline entry",
    "minidist.pipeline.SimResult": "a dataclass: a simulated timeline",
    "minidist.pipeline.simulate": "discrete-event simulation on floats: no tensor",
    "minidist.pipeline.balanced_boundaries": "pure int arithmetic (linear partition by dynamic programming)",
    "minidist.pipeline.StepStats": "a dataclass of numbers returned by run_schedule",
    "minidist.pipeline.timed": "a trace span (and sleep padding) around compute: makes no tensor",
    "minidist.pipeline.slots_from_trace": "reads a trace's events (no tensor)",
    "minidist.pipeline.replayed_slots": "replays a trace's events at fixed costs (no tensor)",
    "minidist.pipeline.bubble_of": "arithmetic on a timeline's floats",
    "minidist.pipeline.to_chrome": "writes a timeline as Chrome-trace JSON",
    "minidist.runtime.launch": "the parent side, which makes no tensor of a rank's: every case here runs under it",
    "minidist.runtime.LaunchError": "an exception class",
    "minidist.runtime.LAUNCH_TIMEOUT": "a constant (seconds)",
    "minidist.runtime.init_from_env": "joins torchrun's process group (sets the rank's device); makes no tensor",
    "minidist.runtime.import_optimizers_before_fork": "imports torch.optim's modules in the parent; makes no tensor",
}
