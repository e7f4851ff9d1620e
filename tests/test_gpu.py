"""The GPU suite (``make test-gpu``, ``pytest -m gpu``): the same library on CUDA ranks, each
result against the CPU reference. Two levels, each skipped with its reason on a machine
without enough GPUs: one GPU (kernels, a group of one, the memory meters, the fork rules) and
four (the tour, the deadlock report, a measured bubble, teardown, memory given back).

The pytest process itself never touches CUDA: everything on a GPU runs inside a launch, so
the launcher's fork rule (fork unless the parent initialised CUDA) holds test after test.
"""
import copy
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from minidist import LaunchError
from minidist.runtime.device import visible_gpus

GPUS = visible_gpus()
pytestmark = pytest.mark.gpu


def needs_gpus(n):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPU(s), this machine has {GPUS} visible")


def on_one_gpu(fn, *args):
    [out] = minidist.launch(fn, 1, *args, device="cuda", timeout=120)
    return out


def max_err(a, b):
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


# ------------------------------------------------------------------------------ one GPU
def _attention_on_cuda():
    from minidist.context_parallel import local_attention
    dev = minidist.device()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 16, generator=g) for _ in range(3))
    errors = {}
    for causal in (False, True):
        cpu_in = [t.clone().requires_grad_() for t in (q, k, v)]
        cuda_in = [t.to(dev).requires_grad_() for t in (q, k, v)]
        out_ref, lse_ref = local_attention(*cpu_in, causal=causal)
        out, lse = local_attention(*cuda_in, causal=causal)
        assert out.device == dev and lse.device == dev, (out.device, lse.device)
        out_ref.sum().backward()
        out.sum().backward()
        errors[causal] = max([max_err(out, out_ref), max_err(lse, lse_ref)]
                             + [max_err(a.grad, b.grad) for a, b in zip(cuda_in, cpu_in)])
    return str(dev), errors


@needs_gpus(1)
def test_local_attention_on_cuda_equals_the_cpu_reference():
    dev, errors = on_one_gpu(_attention_on_cuda)
    assert dev == "cuda:0"
    assert errors[False] < 1e-5 and errors[True] < 1e-5, errors


def _tensor_parallel_group_of_one():
    from minidist.models import GPTConfig, TinyGPT, gpt_batch, gpt_loss
    from minidist.tensor_parallel import grads_as_params, max_grad_error, tensor_parallel_gpt
    dev = minidist.device()
    cfg = GPTConfig()
    ref = TinyGPT(cfg, device="cpu")      # the reference stays on the CPU; models default to the rank's GPU
    ours = tensor_parallel_gpt(copy.deepcopy(ref).to(dev), None)
    ids, targets = gpt_batch(0, 4, cfg.seq_len, cfg.vocab, device="cpu")
    loss_ref = gpt_loss(ref(ids), targets)
    loss_ref.backward()
    loss = ours.loss(ours(ids.to(dev)), targets.to(dev))
    loss.backward()
    ours.sync_grads()
    assert all(p.grad.device == dev for p in ours.parameters())
    # The reference's gradients, cut as ours was and moved to the GPU, are what ours must hold.
    expected = tensor_parallel_gpt(grads_as_params(ref).to(dev), None)
    return max_err(loss, loss_ref), max_grad_error(ours, expected)


@needs_gpus(1)
def test_tensor_parallel_in_a_group_of_one_on_cuda_equals_the_cpu_reference():
    loss_err, grad_err = on_one_gpu(_tensor_parallel_group_of_one)
    assert loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)


def _pipeline_of_one():
    from minidist.models import block_stack, regression_batch
    from minidist.pipeline import make, partition, rank_chunks, run_schedule
    dev = minidist.device()
    x, y = regression_batch(16, 8, device="cpu")
    ref = block_stack(4, 8, device="cpu")
    loss_ref = F.mse_loss(ref(x), y)
    loss_ref.backward()
    chunks = rank_chunks(partition(block_stack(4, 8).to(dev), 1), 1, 0)
    stats = run_schedule(make("1f1b", 1, 4), chunks, x.to(dev), y.to(dev))
    grads = [q.grad for c in chunks for q in c.parameters()]
    assert all(g.device == dev for g in grads)
    return abs(stats.loss - loss_ref.item()), max(max_err(a, b.grad) for a, b in zip(grads, ref.parameters()))


@needs_gpus(1)
def test_the_pipeline_executor_with_one_stage_on_cuda_equals_the_cpu_reference():
    loss_err, grad_err = on_one_gpu(_pipeline_of_one)
    assert loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)


N_FLOATS = 1 << 20         # 4 MiB: a multiple of the caching allocator's rounding, so counted exactly


def _memory_meters():
    from minidist.memory import peak_bytes
    dev = minidist.device()

    def two_buffers_then_free():
        a = torch.ones(N_FLOATS, device=dev)
        b = a * 2
        del a, b

    def keep_one():
        return torch.ones(N_FLOATS, device=dev)

    _, peak, net = peak_bytes(two_buffers_then_free, device=dev)
    kept, peak_kept, net_kept = peak_bytes(keep_one, device=dev)
    return peak, net, peak_kept, net_kept, kept


@needs_gpus(1)
def test_the_memory_meters_count_cuda_allocations_exactly():
    peak, net, peak_kept, net_kept, kept = on_one_gpu(_memory_meters)
    assert (peak, net) == (2 * 4 * N_FLOATS, 0)
    assert (peak_kept, net_kept) == (4 * N_FLOATS, 4 * N_FLOATS)
    assert kept.device.type == "cpu" and kept.numel() == N_FLOATS   # made on cuda:0; the launcher brings it home


def _ddp_step_traced():
    from minidist.data_parallel import BucketedDDP
    from minidist.models import block_stack, regression_batch
    from minidist.trace import trace
    dev = minidist.device()
    x, y = regression_batch(8, 8, device="cpu")
    ref = block_stack(2, 8, device="cpu")
    F.mse_loss(ref(x), y).backward()
    model = BucketedDDP(block_stack(2, 8).to(dev))
    with trace() as t:
        F.mse_loss(model(x.to(dev)), y.to(dev)).backward()
    grads = [q.grad for q in model.parameters()]
    return ({"backend": str(dist.get_backend()), "grad_devices": sorted({str(g.device) for g in grads}),
             "ops": sorted((e.op, e.nbytes) for e in t.comm()), "param_bytes": sum(4 * q.numel() for q in grads),
             "err": max(max_err(a, b.grad) for a, b in zip(grads, ref.parameters()))})


@needs_gpus(1)
def test_a_one_rank_cuda_launch_all_reduces_in_backward_hooks_traced():
    out = on_one_gpu(_ddp_step_traced)
    assert "nccl" in out["backend"], out["backend"]
    assert out["grad_devices"] == ["cuda:0"]
    assert {op for op, _ in out["ops"]} == {"all_reduce"}
    assert sum(n for _, n in out["ops"]) == out["param_bytes"]     # every gradient byte, once
    assert out["err"] < 1e-5


FORK_PROBE = """
import json, threading, torch, minidist
lock = threading.Lock()                 # cloudpickle cannot ship this: only a forked rank can run f
def f():
    with lock:
        return str(minidist.device()), torch.ones(2, device=minidist.device()).sum().item()
first = minidist.launch(f, 1, device="cuda")
second = minidist.launch(f, 1, device="cuda")
print(json.dumps({"first": first, "second": second, "parent_cuda": torch.cuda.is_initialized()}))
"""


@needs_gpus(1)
def test_cuda_ranks_fork_and_leave_the_parents_cuda_uninitialised():
    proc = subprocess.run([sys.executable, "-c", FORK_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"first": [["cuda:0", 2.0]], "second": [["cuda:0", 2.0]], "parent_cuda": False}


# ------------------------------------------------------------------------------ four GPUs
@needs_gpus(4)
def test_the_tour_passes_on_cuda_ranks():
    from minidist.tour import run_tour
    rows = run_tour()
    failed = [(r["technique"], r.get("note")) for r in rows if not r["passed"]]
    assert rows and not failed, failed


def _ring_where_everyone_receives_first():
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(1000, device=minidist.device())
    dist.recv(buf, src=(rank - 1) % n)
    dist.send(buf, dst=(rank + 1) % n)


@needs_gpus(4)
def test_an_nccl_deadlock_names_each_rank_its_op_and_line():
    timeout = 5.0
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        minidist.launch(_ring_where_everyone_receives_first, 4, device="cuda", timeout=timeout)
    assert time.monotonic() - start < 120 + timeout + 15       # start-up, the group timeout, NCCL's abort
    message = str(info.value)
    for rank in range(4):
        assert f"rank {rank}" in message
        assert f"recv(src={(rank - 1) % 4}" in message, message
    assert "dist.recv(buf, src=(rank - 1) % n)" in message, message


@needs_gpus(4)
def test_a_measured_pipeline_bubble_on_cuda_ranks_is_near_theory():
    from minidist.cost import pipeline_bubble
    from minidist.harness.pipeline import measure
    from minidist.pipeline import Costs, bubble_of, make
    costs = Costs(F=0.05, B=0.1)
    slots, _ = measure(make("1f1b", 4, 8), costs=costs)
    measured, theory = bubble_of(slots, 4), pipeline_bubble("1f1b", 4, 8, t_f=costs.F, t_b=costs.B)
    assert abs(measured - theory) < 0.05, (measured, theory)


def _all_reduce_then_return():
    t = torch.full((4,), float(dist.get_rank() + 1), device=minidist.device())
    dist.all_reduce(t)
    return t


@needs_gpus(4)
def test_every_rank_destroys_its_communicators(monkeypatch, tmp_path):
    real = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):         # runs in the forked ranks
        rank = dist.get_rank()
        real(*args, **kwargs)
        (tmp_path / f"rank{rank}").write_text(str(dist.is_initialized()))

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    out = minidist.launch(_all_reduce_then_return, 4, device="cuda", start_method="fork")
    assert all(torch.equal(t, torch.full((4,), 10.0)) for t in out)
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}" for r in range(4)]
    assert {(tmp_path / f).read_text() for f in os.listdir(tmp_path)} == {"False"}


def _hold_gpu_memory():
    keep = torch.empty(256 << 20, dtype=torch.uint8, device=minidist.device())      # 256 MiB
    dist.barrier()
    return os.getpid(), keep.numel()


def _gpu_pids():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)
    return {int(p) for p in out.stdout.split() if p.strip().isdigit()}


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi to see GPU memory from outside")
@needs_gpus(4)
def test_gpu_memory_is_given_back_after_a_launch():
    out = minidist.launch(_hold_gpu_memory, 4, device="cuda")
    pids = {pid for pid, _ in out}
    assert len(pids) == 4 and all(n == 256 << 20 for _, n in out)
    deadline = time.monotonic() + 10         # the driver frees a killed process's memory asynchronously
    while pids & _gpu_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pids & _gpu_pids()
    assert not torch.cuda.is_initialized()
