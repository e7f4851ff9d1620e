"""Reusable checks for the data-parallel labs (lab 2: DDP; lab 3: ZeRO / FSDP).

Same idea as :mod:`minidist.checks`: one call runs a student's function or class on N
ranks, compares with single-process training (:func:`minidist.models.train_reference`)
and with the traced communication, and raises ``AssertionError`` saying in words what is
wrong. A lab test cell is a one-liner::

    checks_dp.check_average_gradients(average_gradients)
    checks_dp.check_bucketed_ddp(BucketedDDP, hidden=True)

Equality runs use SGD with momentum: Adam divides by the gradient's own scale, so it
would not notice a gradient that was summed instead of averaged. Every rank trains on its
contiguous slice of the same global batch (:func:`minidist.models.mlp_batch`); the
reference trains one process on the whole batch. A deadlock fails after ``timeout``
seconds with the launcher's diagnosis, prefixed with the case that was running.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from minidist.models import TinyMLP, flat_parameters, make_optimizer, mlp_batch, train_reference
from minidist.checks import default_timeout
from minidist.trace import trace

TOL = 1e-5
DEFAULT_TIMEOUT = default_timeout(20.0)
# Models every data-parallel implementation must survive (minidist.models.TinyMLP switches).
MODELS = {"plain": {}, "tied": {"tied": True}, "frozen": {"frozen": True}, "unused": {"unused": True}}


@contextlib.contextmanager
def one_thread():
    """Tiny models in this process: one intra-op thread (on a busy 2-core machine, two
    threads make a 3-step reference run 100x slower, not faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def describe_model(kw: dict) -> str:
    return "TinyMLP(" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")" if kw else "TinyMLP()"


# ----------------------------------------------------------------------------- running
def _run_with_progress(body, n, cases, name, timeout, *args):
    """Launch ``body(cases, progress_dir, *args)`` on n ranks; a failure names the case."""
    progress = tempfile.mkdtemp(prefix="minidist-check-")
    try:
        return minidist.launch(body, n, cases, progress, *args, timeout=timeout)
    except minidist.LaunchError as err:
        running = sorted({open(os.path.join(progress, p)).read() for p in os.listdir(progress)})
        raise minidist.LaunchError(f"{name} (world_size={n}, {' / '.join(running) or 'setup'}) failed:\n{err}",
                                   err.failures) from None
    finally:
        shutil.rmtree(progress, ignore_errors=True)


def _mark(progress, text):
    with open(os.path.join(progress, f"rank{dist.get_rank()}"), "w") as f:
        f.write(text)


def local_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of the global batch (the reference split)."""
    local = x.shape[0] // world_size
    return x[rank * local:(rank + 1) * local]


def _train_dp(kind, impl, model_kwargs, steps, batch, cap, trace_last=True):
    """Train a TinyMLP with the student's gradient sync; trace the last step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyMLP(**model_kwargs)
    if kind == "naive":
        net, sync = model, (lambda: impl(model))
    else:
        net = impl(model, bucket_cap_bytes=cap)
        sync = net.finish_gradient_sync
    opt = make_optimizer(model.parameters(), "sgd", 1e-2)
    t = None
    for step in range(steps):
        x, y = mlp_batch(step, batch, model.inp.in_features, model.out.out_features)
        x, y = local_slice(x, rank, n), local_slice(y, rank, n)
        if step == steps - 1 and trace_last:
            with trace() as t:
                F.mse_loss(net(x), y).backward()
                sync()
        else:
            F.mse_loss(net(x), y).backward()
            sync()
        opt.step()
        opt.zero_grad()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    events = [(e.op, e.nbytes) for e in t.comm()] if t is not None else []
    buckets = len(getattr(net, "buckets", [])) if kind == "bucketed" else None
    return {"params": flat_parameters(model), "numel": numel, "events": events, "buckets": buckets}


def _dp_body(cases, progress, kind, impl):
    out = []
    for case in cases:
        _mark(progress, f"{describe_model(case['model_kwargs'])}, {case['steps']} steps, batch {case['batch']}"
              + (f", bucket_cap_bytes={case['cap']}" if kind == "bucketed" else ""))
        out.append(_train_dp(kind, impl, case["model_kwargs"], case["steps"], case["batch"], case.get("cap")))
    return out


def _reference(case):
    return flat_parameters(train_reference(TinyMLP(**case["model_kwargs"]), case["steps"], case["batch"],
                                           optimizer="sgd"))


def _check_equal(name, n, cases, out):
    with one_thread():
        _check_equal_1(name, n, cases, out)


def _check_equal_1(name, n, cases, out):
    for i, case in enumerate(cases):
        ref = _reference(case)
        what = f"{name} (world_size={n}, {describe_model(case['model_kwargs'])}, {case['steps']} SGD steps" + \
               (f", bucket_cap_bytes={case['cap']})" if case.get("cap") else ")")
        for r in range(n):
            got = out[r][i]["params"]
            err = (got - ref).abs().max().item()
            if not err <= TOL:       # NaN fails too
                local = _local_only(case, r, n)
                hint = ""
                if (got - local).abs().max().item() < TOL:
                    hint = " The parameters equal training on this rank's slice alone: the gradients were never synchronised."
                elif _scaled_reference_close(case, got, n):
                    hint = (" The parameters equal training with gradients summed instead of averaged"
                            " (or averaged twice): check the division by the world size.")
                raise AssertionError(f"{what}: rank {r}'s parameters differ from single-process training on "
                                     f"the whole batch, max |error| = {err:.3g} (tolerance {TOL:g}).{hint}")
        if any(not torch.equal(out[r][i]["params"], out[0][i]["params"]) for r in range(n)):
            raise AssertionError(f"{what}: the ranks ended with different parameters; after every step all "
                                 f"replicas must be identical (every rank must apply the same averaged gradient)")


def _local_only(case, rank, n):
    model = TinyMLP(**case["model_kwargs"])
    opt = make_optimizer(model.parameters(), "sgd", 1e-2)
    for step in range(case["steps"]):
        x, y = mlp_batch(step, case["batch"], model.inp.in_features, model.out.out_features)
        F.mse_loss(model(local_slice(x, rank, n)), local_slice(y, rank, n)).backward()
        opt.step()
        opt.zero_grad()
    return flat_parameters(model)


def _scaled_reference_close(case, got, n):
    for scale in (n, 1 / n):
        model = TinyMLP(**case["model_kwargs"])
        opt = make_optimizer(model.parameters(), "sgd", 1e-2)
        for step in range(case["steps"]):
            x, y = mlp_batch(step, case["batch"], model.inp.in_features, model.out.out_features)
            (scale * F.mse_loss(model(x), y)).backward()
            opt.step()
            opt.zero_grad()
        if (flat_parameters(model) - got).abs().max().item() < TOL:
            return True
    return False


def _cases(hidden, models, cap=None, steps=3, batch=24):
    return [dict(model_kwargs=MODELS[m], steps=steps, batch=batch, cap=cap) for m in models]


# ----------------------------------------------------------------------------- lab 2: split
def check_split_batch(split_batch, hidden: bool = False) -> None:
    """``split_batch(x, y, rank, world_size)`` -> rank's contiguous block of x and of y;
    a batch that does not divide by world_size raises ValueError. Pure: no launch."""
    sizes = [(12, 2), (12, 3), (12, 4)] + ([(24, 4), (5, 5), (7, 1), (30, 6)] if hidden else [])
    for batch, n in sizes:
        x, y = torch.arange(batch * 3.0).view(batch, 3), torch.arange(batch * 2.0).view(batch, 2) + 1000
        xs, ys = [], []
        for r in range(n):
            got = split_batch(x, y, r, n)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}) must return a "
                                     f"tuple (x_local, y_local), got {type(got).__name__}")
            xr, yr = got
            for what, t, full in (("x", xr, x), ("y", yr, y)):
                if not isinstance(t, torch.Tensor) or t.shape != (batch // n, full.shape[1]):
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}): {what}_local has "
                                         f"shape {shape}; expected {(batch // n, full.shape[1])} (batch / world_size rows)")
            want = slice(r * (batch // n), (r + 1) * (batch // n))
            if not (torch.equal(xr, x[want]) and torch.equal(yr, y[want])):
                rows = [int(v) for v in (xr[:, 0] / 3).tolist()]
                raise AssertionError(f"split_batch(batch={batch}, rank={r}, world_size={n}): rank {r} got rows "
                                     f"{rows} of x; expected the contiguous block {list(range(want.start, want.stop))} "
                                     f"(and the same rows of y)")
            xs.append(xr)
            ys.append(yr)
        if not torch.equal(torch.cat(xs), x):
            raise AssertionError(f"split_batch(batch={batch}, world_size={n}): the ranks' slices together are not the batch")
    for batch, n in [(10, 4)] + ([(7, 2), (3, 4)] if hidden else []):
        x, y = torch.zeros(batch, 3), torch.zeros(batch, 2)
        try:
            split_batch(x, y, 0, n)
        except ValueError:
            continue
        raise AssertionError(f"split_batch(batch={batch}, world_size={n}) must raise ValueError: {batch} rows do not "
                             f"split evenly into {n} ranks (silently dropping rows changes the loss)")


# ----------------------------------------------------------------------------- lab 2: naive DDP
def check_average_gradients(average_gradients, hidden: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Training with ``average_gradients(model)`` after every backward equals single-process
    training on the whole batch (SGD with momentum, 3 steps)."""
    sizes = (3, 4) if hidden else (2,)
    models = list(MODELS) if hidden else ["plain", "frozen"]
    for n in sizes:
        cases = _cases(hidden, models)
        out = _run_with_progress(_dp_body, n, cases, "average_gradients", timeout, "naive", average_gradients)
        _check_equal("average_gradients", n, cases, out)


def check_average_gradients_traffic(average_gradients, timeout: float = DEFAULT_TIMEOUT) -> None:
    """One all-reduce per trainable parameter, Ψ·4 bytes of payload in all, nothing else."""
    for n in (2, 3):
        cases = _cases(False, ["frozen", "tied"])
        out = _run_with_progress(_dp_body, n, cases, "average_gradients", timeout, "naive", average_gradients)
        for i, case in enumerate(cases):
            for r in range(n):
                res = out[r][i]
                what = f"average_gradients (world_size={n}, {describe_model(case['model_kwargs'])}), rank {r}"
                ops = sorted({op for op, _ in res["events"]})
                if ops != ["all_reduce"]:
                    raise AssertionError(f"{what}: expected only all_reduce calls, saw {ops or 'no communication'}")
                n_params = len([p for p in TinyMLP(**case["model_kwargs"]).parameters() if p.requires_grad])
                total = sum(b for _, b in res["events"])
                if total != 4 * res["numel"]:
                    raise AssertionError(f"{what}: all-reduced {total} bytes of gradients per step; expected "
                                         f"Ψ·4 = {4 * res['numel']} (every trainable parameter's gradient once; "
                                         f"frozen parameters have none, a tied weight counts once)")
                if len(res["events"]) != n_params:
                    raise AssertionError(f"{what}: {len(res['events'])} all-reduces per step; expected one per "
                                         f"trainable parameter ({n_params})")


# ----------------------------------------------------------------------------- lab 2: buckets
def _expected_buckets(sizes, cap):
    out, cur, size = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and size + sizes[i] > cap:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += sizes[i]
    return out + ([cur] if cur else [])


def check_make_buckets(make_buckets, hidden: bool = False) -> None:
    """Greedy buckets of at most ``cap_bytes``, in reverse parameter order; a tensor bigger
    than the cap gets a bucket of its own. Pure: no launch."""
    shapes = [(13, 6), (13,), (13, 13), (13,), (13, 13), (13,), (5, 13), (5,)]
    configs = [(shapes, 700), (shapes, 2000)]
    if hidden:
        configs += [(shapes, 4), (shapes, 10 ** 6), (shapes, 676), (shapes, 728), ([(3,)], 12), ([(100,), (1,), (1,)], 8)]
    for shp, cap in configs:
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shp]
        sizes = [p.numel() * 4 for p in params]
        got = make_buckets(params, cap)
        idx = {id(p): i for i, p in enumerate(params)}
        try:
            got_idx = [[idx[id(p)] for p in b] for b in got]
        except (KeyError, TypeError):
            raise AssertionError(f"make_buckets(cap_bytes={cap}) must return a list of lists of the given "
                                 f"parameters, got {got!r:.200}") from None
        want = _expected_buckets(sizes, cap)
        if got_idx != want:
            raise AssertionError(
                f"make_buckets(params of {sizes} bytes, cap_bytes={cap}): got buckets (as parameter indices) "
                f"{got_idx}; expected {want}. Buckets are filled greedily in REVERSE order (the order backward "
                f"produces gradients), a bucket holds at most cap_bytes unless one tensor alone is bigger, and "
                f"every parameter appears exactly once.")


def check_bucketed_ddp(BucketedDDP, hidden: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Training with ``BucketedDDP(model, bucket_cap_bytes)`` (``finish_gradient_sync()``
    after every backward) equals single-process training on the whole batch."""
    sizes = (3, 4) if hidden else (2,)
    for n in sizes:
        cases = [dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=700),
                 dict(model_kwargs=MODELS["unused"], steps=3, batch=24, cap=700)]
        if hidden:
            cases += [dict(model_kwargs=MODELS["tied"], steps=3, batch=24, cap=300),
                      dict(model_kwargs={"tied": True, "frozen": True, "unused": True}, steps=3, batch=24, cap=4),
                      dict(model_kwargs=MODELS["plain"], steps=3, batch=24, cap=1 << 20)]
        out = _run_with_progress(_dp_body, n, cases, "BucketedDDP", timeout, "bucketed", BucketedDDP)
        _check_equal("BucketedDDP", n, cases, out)


def check_bucketed_ddp_traffic(BucketedDDP, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Per step: one all-reduce per bucket (not per parameter), Ψ·4 bytes of payload in all."""
    for n in (2, 3):
        cases = [dict(model_kwargs=MODELS["plain"], steps=2, batch=24, cap=700),
                 dict(model_kwargs={"unused": True, "frozen": True}, steps=2, batch=24, cap=2000)]
        out = _run_with_progress(_dp_body, n, cases, "BucketedDDP", timeout, "bucketed", BucketedDDP)
        for i, case in enumerate(cases):
            for r in range(n):
                res = out[r][i]
                what = (f"BucketedDDP (world_size={n}, {describe_model(case['model_kwargs'])}, "
                        f"bucket_cap_bytes={case['cap']}), rank {r}")
                ops = sorted({op for op, _ in res["events"]})
                if ops != ["all_reduce"]:
                    raise AssertionError(f"{what}: expected only all_reduce calls, saw {ops or 'no communication'}")
                total = sum(b for _, b in res["events"])
                if total != 4 * res["numel"]:
                    raise AssertionError(f"{what}: all-reduced {total} bytes per step; expected Ψ·4 = "
                                         f"{4 * res['numel']} (each gradient exactly once)")
                if len(res["events"]) != res["buckets"]:
                    raise AssertionError(f"{what}: {len(res['events'])} all-reduces per step for "
                                         f"{res['buckets']} buckets; expected one all-reduce per bucket "
                                         f"(that is the point of bucketing: fewer, bigger messages)")


def _overlap_body(BucketedDDP, cap):
    model = TinyMLP(hidden=48, n_hidden=4)
    ddp = BucketedDDP(model, bucket_cap_bytes=cap)
    marks = {}
    # the input layer's weight is the last gradient backward produces

    def last_gradient(p):
        marks.setdefault("last", time.perf_counter())

    model.inp.weight.register_post_accumulate_grad_hook(last_gradient)
    x, y = mlp_batch(0, 16, 6, 5)
    with trace() as t:
        F.mse_loss(ddp(x), y).backward()
        backward_done = time.perf_counter()
        ddp.finish_gradient_sync()
    starts = sorted(e.start for e in t.comm() if e.op == "all_reduce")
    return {"starts": starts, "last": marks.get("last"), "backward_done": backward_done,
            "buckets": len(ddp.buckets)}


def check_overlap(BucketedDDP, timeout: float = DEFAULT_TIMEOUT) -> None:
    """The first bucket's all-reduce starts from a gradient hook, before backward has
    produced its last gradient (communication overlaps the rest of backward)."""
    out = minidist.launch(_overlap_body, 2, BucketedDDP, 2048, timeout=timeout)
    for r, res in enumerate(out):
        if len(res["starts"]) < 2:
            raise AssertionError(f"BucketedDDP overlap (world_size=2, bucket_cap_bytes=2048), rank {r}: "
                                 f"{len(res['starts'])} all-reduce(s) for {res['buckets']} buckets")
        if res["last"] is None or not res["starts"][0] < res["last"]:
            raise AssertionError(
                f"BucketedDDP overlap (world_size=2, bucket_cap_bytes=2048), rank {r}: no all-reduce started "
                f"before backward produced its last gradient. Launch a bucket's all-reduce with async_op=True "
                f"from the gradient hook as soon as the bucket is full, not after backward.")


# ----------------------------------------------------------------------------- lab 2: measurements
def _step_time_body(BucketedDDP, caps, model_kwargs, steps, batch):
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for cap in caps:
        model = TinyMLP(**model_kwargs)
        ddp = BucketedDDP(model, bucket_cap_bytes=cap)
        opt = make_optimizer(model.parameters(), "sgd", 1e-3)
        x, y = mlp_batch(0, batch, model.inp.in_features, model.out.out_features)
        x, y = local_slice(x, rank, n), local_slice(y, rank, n)
        times = []
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            F.mse_loss(ddp(x), y).backward()
            ddp.finish_gradient_sync()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        rows.append({"cap": cap, "buckets": len(ddp.buckets), "times": times[1:]})
    return rows


def step_time_vs_bucket_size(BucketedDDP, caps, world_size: int = 2, model_kwargs=None, steps: int = 5,
                             batch: int = 64, timeout: float = 60.0) -> list[dict]:
    """Median step time (slowest rank) of ``BucketedDDP`` for each bucket cap:
    rows of {cap, buckets, step_ms}."""
    model_kwargs = model_kwargs or {"hidden": 256, "n_hidden": 6}
    out = minidist.launch(_step_time_body, world_size, BucketedDDP, list(caps), model_kwargs, steps, batch,
                          timeout=timeout)
    rows = []
    for i, cap in enumerate(caps):
        per_step = [max(o[i]["times"][s] for o in out) for s in range(steps)]
        rows.append({"cap": cap, "buckets": out[0][i]["buckets"],
                     "step_ms": 1e3 * sorted(per_step)[len(per_step) // 2]})
    return rows


# ============================================================================= lab 3: ZeRO / FSDP
# The lab's wrapper class ``Zero(model, stage, optimizer="adam", lr=1e-2)`` (given in the
# notebook, built on the student's functions) has: ``__call__(x)``, ``finish_backward()``
# (after loss.backward()), ``step()``, ``zero_grad()``, ``state_tensors()`` (every
# parameter-like tensor held), ``optimizer`` and ``full_parameters()`` (flat fp32 vector).
ZERO_MODELS = {"plain": {}, "frozen": {"frozen": True}, "unused": {"unused": True}}
MEMORY_MODEL = {"hidden": 32, "n_hidden": 3}     # Ψ ≈ 3.6 k: padding and Adam's step counters < 1%


def _train_zero(Zero, stage, model_kwargs, steps, batch, optimizer, measure=False):
    from minidist.memory import model_state_bytes
    rank, n = dist.get_rank(), dist.get_world_size()
    model = TinyMLP(**model_kwargs)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    zero = Zero(model, stage, optimizer=optimizer, lr=1e-2)
    t, mem = None, {}
    for step in range(steps):
        x, y = mlp_batch(step, batch, model.inp.in_features, model.out.out_features)
        x, y = local_slice(x, rank, n), local_slice(y, rank, n)
        last = step == steps - 1
        with trace() if last else contextlib.nullcontext() as t_step:
            F.mse_loss(zero(x), y).backward()
            if last and measure:        # stage 2+: the hooks must have sharded the gradients by now
                mem["after_backward"] = model_state_bytes(zero.state_tensors(), zero.optimizer)
            zero.finish_backward()
            zero.step()
        if last:
            t = t_step
            if measure:
                mem["after_step"] = model_state_bytes(zero.state_tensors(), zero.optimizer)
        zero.zero_grad()
    events = [(e.op, e.nbytes) for e in t.comm()]
    return {"params": zero.full_parameters(), "numel": numel, "events": events, "memory": mem}


def _zero_body(cases, progress, Zero):
    out = []
    for c in cases:
        _mark(progress, f"stage {c['stage']}, {describe_model(c['model_kwargs'])}, {c['optimizer']}, {c['steps']} steps")
        out.append(_train_zero(Zero, c["stage"], c["model_kwargs"], c["steps"], c["batch"], c["optimizer"],
                               c.get("measure", False)))
    return out


def _zero_reference(case):
    with one_thread():
        return flat_parameters(train_reference(TinyMLP(**case["model_kwargs"]), case["steps"], case["batch"],
                                               optimizer=case["optimizer"]))


def check_zero(Zero, stage: int, hidden: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
    """ZeRO stage ``stage`` trains exactly like one process on the whole batch (Adam, and SGD
    with momentum to catch a wrong gradient scale)."""
    sizes = (3, 4) if hidden else (2,)
    models = ["frozen", "unused"] if hidden else ["plain", "unused"]
    for n in sizes:
        cases = [dict(stage=stage, model_kwargs=ZERO_MODELS[m], steps=3, batch=24, optimizer=o)
                 for m in models for o in ("adam", "sgd")]
        out = _run_with_progress(_zero_body, n, cases, f"Zero(stage={stage})", timeout, Zero)
        for i, case in enumerate(cases):
            ref = _zero_reference(case)
            what = (f"Zero(stage={stage}) (world_size={n}, {describe_model(case['model_kwargs'])}, "
                    f"{case['steps']} {case['optimizer']} steps)")
            for r in range(n):
                err = (out[r][i]["params"] - ref).abs().max().item()
                if not err <= TOL:       # NaN fails too
                    raise AssertionError(f"{what}: rank {r}'s parameters differ from single-process training "
                                         f"on the whole batch, max |error| = {err:.3g} (tolerance {TOL:g})")


def _memory_cases(stage):
    return [dict(stage=stage, model_kwargs=MEMORY_MODEL, steps=2, batch=24, optimizer="adam", measure=True)]


def check_zero_memory(Zero, stage: int, timeout: float = DEFAULT_TIMEOUT, slack: float = 0.05) -> None:
    """Measured model-state bytes per rank (live storages, minidist.memory) within ``slack``
    of the fp32 ZeRO formula (minidist.cost) for N = 2 and 4: optimizer states 8Ψ/N (stages
    1-3), gradients 4Ψ/N after backward (stages 2-3), parameters 4Ψ/N after the step (stage 3).
    An implementation that keeps the unsharded copy is off by a factor of up to N."""
    from minidist.cost import zero_memory_bytes_fp32
    for n in (2, 4):
        out = _run_with_progress(_zero_body, n, _memory_cases(stage), f"Zero(stage={stage}) memory", timeout, Zero)
        for r in range(n):
            res = out[r][0]
            formula = zero_memory_bytes_fp32(stage, res["numel"], n)
            checks = [("optimizer", "after_step", "optimizer states (Adam's two moments)")]
            if stage >= 2:
                checks.append(("grads", "after_backward", "gradients after backward"))
            if stage >= 3:
                checks.append(("params", "after_step", "parameters after the step"))
            for key, when, label in checks:
                got, want = res["memory"][when][key], formula[key]
                if got > (1 + slack) * want:
                    full = {"optimizer": 8, "grads": 4, "params": 4}[key] * res["numel"]
                    raise AssertionError(
                        f"Zero(stage={stage}) (world_size={n}, Ψ={res['numel']}), rank {r}: {label} hold {got} bytes; "
                        f"the formula says {want:.0f} (1/{n} of {full}), measured from live storages. "
                        + {"optimizer": "Is the optimizer built over the shards only?",
                           "grads": "Full gradients must be dropped (p.grad = None) once reduce-scattered.",
                           "params": "Gathered parameters must be freed (storage resized to 0) after use."}[key])


def check_zero_traffic(Zero, stage: int, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Stages 1-2: reduce-scatter + all-gather of Ψ, no all-reduce, the same wire volume as
    DDP (2(N−1)/N·Ψ); stage 3: two all-gathers (forward, backward) and one reduce-scatter,
    3(N−1)/N·Ψ, 1.5x DDP."""
    from minidist.dp_harness import ring_wire_bytes
    for n in (2, 3):
        case = dict(stage=stage, model_kwargs=MEMORY_MODEL, steps=2, batch=24, optimizer="adam")
        out = _run_with_progress(_zero_body, n, [case], f"Zero(stage={stage}) traffic", timeout, Zero)
        for r in range(n):
            res = out[r][0]
            psi = 4 * res["numel"]
            traced: dict = {}
            for op, b in res["events"]:
                traced[op] = traced.get(op, 0) + b
            what = f"Zero(stage={stage}) (world_size={n}, Ψ={res['numel']}), rank {r}, one step"
            if set(traced) != {"reduce_scatter_tensor", "all_gather_into_tensor"}:
                raise AssertionError(f"{what}: expected only reduce_scatter_tensor and all_gather_into_tensor, "
                                     f"saw {sorted(traced) or 'no communication'}")
            rs, ag = traced["reduce_scatter_tensor"], traced["all_gather_into_tensor"]
            gathers = 2 if stage == 3 else 1
            pad = 4 * 16 * n                     # at most N-1 padding elements per unit
            if not psi <= rs <= psi + pad:
                raise AssertionError(f"{what}: reduce-scattered {rs} bytes; expected the padded gradient, "
                                     f"Ψ·4 = {psi} (+ padding), once per step")
            if abs(ag * n - gathers * rs) > 0:
                raise AssertionError(f"{what}: all-gathered {ag} bytes of shards (= {ag * n} bytes of parameters); "
                                     f"expected {gathers}× the parameters ({gathers * rs} bytes)"
                                     + (": once before forward and once before backward" if stage == 3 else
                                        ": once, after the sharded optimizer step"))
            wire = sum(ring_wire_bytes(op, b, n) for op, b in traced.items())
            factor = 3 if stage == 3 else 2
            if abs(wire / psi - factor * (n - 1) / n) > 0.05:
                raise AssertionError(f"{what}: {wire:.0f} wire bytes; expected {factor}(N−1)/N·Ψ·4")


def _unit_body(cases, progress, reduce_scatter_gradients, ShardedUnit):
    """Fill one module's gradients with known values, reduce-scatter them, return the shard grad."""
    import torch.nn as nn
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for shapes in cases:
        _mark(progress, f"a unit of parameters {shapes}")
        module = nn.Module()
        for k, s in enumerate(shapes):
            module.register_parameter(f"p{k}", nn.Parameter(torch.zeros(s)))
        unit = ShardedUnit(module, n, rank)
        with trace() as t:
            for _ in range(2):                  # two micro-batches: the second call must add
                for k, p in enumerate(unit.params):
                    g = torch.Generator().manual_seed(100 * rank + k)
                    p.grad = None if k == len(shapes) - 1 and len(shapes) > 1 else torch.randn(p.shape, generator=g)
                reduce_scatter_gradients(unit)
        grads_left = [p.grad is not None for p in unit.params]
        shard_grad = None if unit.shard.grad is None else unit.shard.grad.clone()
        out.append({"shard_grad": shard_grad, "grads_left": grads_left,
                    "events": [(e.op, e.nbytes) for e in t.comm()], "padded": unit.layout.padded_numel,
                    "shard_numel": unit.layout.shard_numel})
    return out


def check_reduce_scatter_gradients(reduce_scatter_gradients, ShardedUnit, hidden: bool = False,
                                   timeout: float = DEFAULT_TIMEOUT) -> None:
    """On each rank, ``unit.shard.grad`` becomes (accumulates) the average over ranks of this
    rank's shard of the flat, padded gradient (a missing gradient counts as zeros); every
    full ``p.grad`` is dropped; one reduce_scatter_tensor of the padded flat gradient per call."""
    sizes = (2, 3, 4) if hidden else (2,)
    cases = [[(3, 5), (7,)], [(4,), (2, 2), (5,)]] + ([[(1,)], [(6, 7), (6,), (9,)]] if hidden else [])
    for n in sizes:
        out = _run_with_progress(_unit_body, n, cases, "reduce_scatter_gradients", timeout,
                                 reduce_scatter_gradients, ShardedUnit)
        for i, shapes in enumerate(cases):
            what = f"reduce_scatter_gradients (world_size={n}, parameters {shapes})"
            flats = []
            for r in range(n):
                parts = []
                for k, s in enumerate(shapes):
                    g = torch.Generator().manual_seed(100 * r + k)
                    missing = k == len(shapes) - 1 and len(shapes) > 1
                    parts.append(torch.zeros(s).reshape(-1) if missing else torch.randn(s, generator=g).reshape(-1))
                flat = torch.cat(parts)
                flats.append(torch.cat([flat, torch.zeros(out[0][i]["padded"] - flat.numel())]))
            mean = torch.stack(flats).mean(0)
            S = out[0][i]["shard_numel"]
            for r in range(n):
                res = out[r][i]
                if res["shard_grad"] is None:
                    raise AssertionError(f"{what}: rank {r}: unit.shard.grad is None after the call")
                want = 2 * mean[r * S:(r + 1) * S]
                if res["shard_grad"].shape != want.shape or not torch.allclose(res["shard_grad"], want, atol=1e-5):
                    hint = ""
                    if res["shard_grad"].shape == want.shape:
                        if torch.allclose(res["shard_grad"], n * want, atol=1e-5):
                            hint = " It is N times too large: divide the sum by the world size."
                        elif torch.allclose(res["shard_grad"], want / 2, atol=1e-5):
                            hint = " A second call must ADD to unit.shard.grad (gradient accumulation), not replace it."
                    raise AssertionError(f"{what}: rank {r}: after two calls unit.shard.grad should be twice the "
                                         f"average over ranks of shard {r} of the flat padded gradient.{hint}")
                if any(res["grads_left"]):
                    raise AssertionError(f"{what}: rank {r}: p.grad is still set after the reduce-scatter; set it to "
                                         f"None so that the full gradient's memory is released")
                ops = [op for op, _ in res["events"]]
                if ops != ["reduce_scatter_tensor"] * 2:
                    raise AssertionError(f"{what}: rank {r}: expected one reduce_scatter_tensor per call, saw {ops}")
                if any(b != 4 * res["padded"] for _, b in res["events"]):
                    raise AssertionError(f"{what}: rank {r}: each reduce-scatter should take the whole padded flat "
                                         f"gradient ({4 * res['padded']} bytes), saw {[b for _, b in res['events']]}")
