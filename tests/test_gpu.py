"""The GPU suite (``make test-gpu``, ``pytest -m gpu``): the same library on CUDA ranks, each
result against the CPU reference. Levels, each skipped with its reason on a machine
without enough GPUs: one GPU (kernels, a group of one, the memory meters, the fork rules), two
(the grader end to end with ``--gpus-per-job``: each parallel job on GPUs of its own, NCCL inside
the sandbox), four (the tour, the deadlock report, a measured bubble, teardown, memory given
back; every lab's solution, bank and correct alternatives under NCCL) and eight (lab 7's).

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

from conftest import ROOT

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


DRIVER_PROBE = """
import json, torch, minidist
from minidist.runtime.device import parent_initialised_cuda
before = parent_initialised_cuda()
available = torch.cuda.is_available()     # what a student's first cell often does: cuInit, behind torch's back
def f():
    return str(minidist.device()), torch.ones(2, device=minidist.device()).sum().item()
print(json.dumps({"before": before, "after": parent_initialised_cuda(), "available": available,
                  "torch_says": torch.cuda.is_initialized(), "out": minidist.launch(f, 1, device="cuda")}))
"""


@needs_gpus(1)
def test_a_parent_that_initialised_the_driver_behind_torchs_back_spawns_its_ranks():
    """torch.cuda.is_available() initialises the CUDA driver while torch.cuda.is_initialized()
    stays False: a forked rank would fail with "initialization error"; the launcher sees it and spawns."""
    proc = subprocess.run([sys.executable, "-c", DRIVER_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] is False and out["available"] is True and out["after"] is True, out
    assert out["out"] == [["cuda:0", 2.0]], out


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


# ------------------------------------------------------------------------------ the grader on GPUs
def _labs():
    """The labs, as autograder.course.labs.all_labs finds them, read without importing the grader: on a
    GPU node without the dev extras (nbformat, nbgrader) the CUDA tests above still collect and run."""
    solutions = os.path.join(ROOT, "solutions")
    return sorted(d for d in os.listdir(solutions) if os.path.isfile(os.path.join(solutions, d, f"{d}.ipynb")))


LAB_GPUS = {"lab7_3d_parallel": 8}       # a lab's largest launch: every rank on a GPU of its own


@pytest.mark.parametrize("lab", _labs())
def test_every_lab_s_solution_bank_and_alternatives_pass_their_selftest_under_nccl(lab):
    """``selftest --quick`` on CUDA ranks: the solution graded in the sandbox with GPUs of its own
    (``--gpus-per-job``; launches pick CUDA when every rank has a GPU), the release, every bug and
    every correct alternative in the bank's kernels, which see every GPU. One lab at a time."""
    need = LAB_GPUS.get(lab, 4)
    if GPUS < need:
        pytest.skip(f"{lab} under NCCL needs {need} GPUs, this machine has {GPUS} visible")
    r = subprocess.run([sys.executable, "-m", "autograder", "selftest", "--lab", lab, "--quick", "--jobs", "1",
                        "--gpus-per-job", str(need), "--quiet"], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, (r.stdout[-6000:], r.stderr[-3000:])
    assert "selftest: PASSED" in r.stdout


GPU_JOB_CELL = r"""
import json, os
import torch, torch.distributed as dist, minidist
from minidist.runtime.device import visible_gpus

from conftest import ROOT
def _on_every_gpu():
    t = torch.ones(4, device=minidist.device()) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return str(t.device), str(dist.get_backend()), t.sum().item()
_n = visible_gpus()
_st = os.statvfs("/dev/shm")
print("GPUJOB " + json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": _n,
                              "launch": minidist.launch(_on_every_gpu, _n, device="cuda", timeout=120),
                              "dev": sorted(os.listdir("/dev")), "shm": _st.f_blocks * _st.f_frsize}))
"""


@needs_gpus(2)
def test_grade_gives_each_parallel_job_gpus_of_its_own_end_to_end(tmp_path):
    """``grade --jobs 2 --gpus-per-job K`` on the fixture lab, in the sandbox: every job sees its own
    K GPUs (CUDA_VISIBLE_DEVICES, disjoint from the other job's), the GPU devices and a 4 GiB
    /dev/shm, runs NCCL across its K GPUs, and the honest solution keeps full marks with the
    confirmation on (which runs on the same GPUs)."""
    import csv
    from autograder.course.cells import read_nb, solution_submission, write_nb
    from autograder.course.template import build_course
    from autograder.grading.grade import visible_gpu_ids
    from autograder.sandbox.backend import shm_bytes
    from autograder_fixtures import LAB, SOLUTIONS, with_cell
    ids = visible_gpu_ids()             # the grader's CUDA_VISIBLE_DEVICES (a scheduler's), else every GPU
    per = min(4, len(ids) // 2)
    env = dict(os.environ, MINIDIST_SOLUTIONS=str(SOLUTIONS), MINIDIST_LABS=str(tmp_path / "labs"))
    old = {k: os.environ.get(k) for k in ("MINIDIST_SOLUTIONS", "MINIDIST_LABS")}
    os.environ.update({k: env[k] for k in old})
    try:
        course = build_course([LAB], tmp_path / "course")
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    sol = solution_submission(read_nb(course / "source" / LAB / f"{LAB}.ipynb"),
                              read_nb(course / "release" / LAB / f"{LAB}.ipynb"))
    students = [f"s{k}" for k in range(4)]
    for s in students:
        write_nb(with_cell(sol, GPU_JOB_CELL), tmp_path / "subs" / s / LAB / f"{LAB}.ipynb")
    r = subprocess.run([sys.executable, "-m", "autograder", "grade", str(tmp_path / "subs"), "--out",
                        str(tmp_path / "out"), "--jobs", "2", "--gpus-per-job", str(per), "--lab", LAB, "--sandbox",
                        "--cell-timeout", "300", "--quiet"], capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    slots = results["gpu_slots"]
    assert slots == [",".join(ids[k * per:(k + 1) * per]) for k in range(2)], slots
    grades = {row["student_id"]: row["score"] for row in csv.DictReader(open(tmp_path / "out" / "grades.csv"))}
    assert grades == {s: "3.0" for s in students}, (grades, r.stdout[-2000:])
    for sub in results["submissions"]:
        nb = read_nb(tmp_path / "out" / "autograded" / sub["student"] / LAB / f"{LAB}.ipynb")
        said = [line for c in nb.cells for o in c.get("outputs", []) for line in str(o.get("text", "")).splitlines()
                if line.startswith("GPUJOB ")]
        assert said, sub
        seen = json.loads(said[0][len("GPUJOB "):])
        assert sub["gpus"] in slots and seen["visible"] == sub["gpus"] and seen["count"] == per, (sub, seen)
        assert "nvidiactl" in seen["dev"] and seen["shm"] == shm_bytes(), seen
        expected = per * (per + 1) / 2 * 4
        assert all(d.startswith("cuda") and "nccl" in b and total == expected for d, b, total in seen["launch"]), seen
        assert all(t["confirmed"] and not str(t["confirmed"]).startswith("failed") for t in sub["tests"]), sub
    assert results["confirmation"] is True


# ------------------------------------------------------------------------------ overlap (two GPUs)
def _collective_matmuls_on_cuda():
    from minidist.overlap import all_gather_matmul, fused_all_gather_matmul, fused_available, \
        fused_matmul_reduce_scatter, matmul_reduce_scatter
    from minidist.tensor_parallel import reduce_scatter_along_dim, sequence_parallel_linear
    dev, rank, t = minidist.device(), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8 * t, 64, generator=g).to(dev)
    w = torch.randn(32, 64, generator=g).to(dev)
    shard = x.chunk(t, 1)[rank].contiguous()
    errs = {"ag": max_err(all_gather_matmul(shard, w), sequence_parallel_linear(shard, w)),
            "rs": max_err(matmul_reduce_scatter(x * (rank + 1), w),
                          reduce_scatter_along_dim(F.linear(x * (rank + 1), w), 1))}
    ok, why = fused_available(shard)
    if ok:
        errs["torch ag"] = max_err(fused_all_gather_matmul(shard, w), sequence_parallel_linear(shard, w))
        errs["torch rs"] = max_err(fused_matmul_reduce_scatter(x * (rank + 1), w),
                                   reduce_scatter_along_dim(F.linear(x * (rank + 1), w), 1))
    return errs, why


@needs_gpus(2)
def test_ring_collective_matmuls_on_cuda_equal_the_plain_ones_and_torch_s_fused_ops():
    """NCCL's p2p under the ring; torch's symmetric-memory ops as the reference where this GPU has them
    (the reason is reported when it has not)."""
    for errs, why in minidist.launch(_collective_matmuls_on_cuda, 2, device="cuda", timeout=300):
        assert all(e < 1e-3 for e in errs.values()), errs       # TF32 matmuls may be on: 1e-3
        if "torch ag" not in errs:
            print(f"torch's fused ops not compared: {why}")
