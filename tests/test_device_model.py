"""The device model on a CPU machine: which device a launch asks for, what ranks see, what the
parent never does (initialise CUDA), and what every rank undoes (its process group)."""
import importlib
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import minidist
from conftest import forbid_starting_processes
from minidist.runtime.device import resolve_device

# By module path: the package's attribute ``minidist.runtime.device`` is the function device().
device_model = importlib.import_module("minidist.runtime.device")
launcher = importlib.import_module("minidist.runtime.launcher")
rank_process = importlib.import_module("minidist.runtime.rank_process")


@pytest.mark.parametrize("requested, gpus, world_size, expected", [
    (None, 0, 4, "cpu"), (None, 1, 4, "cpu"), (None, 4, 4, "cuda"), (None, 1, 1, "cuda"), (None, 0, 1, "cpu"),
    ("cpu", 0, 4, "cpu"), ("cpu", 1, 4, "cpu"), ("cpu", 4, 4, "cpu"),
    ("cuda", 4, 4, "cuda"), ("cuda", 1, 1, "cuda"), (torch.device("cuda"), 4, 2, "cuda"),
    ("cuda", 0, 4, "has 0 visible GPU(s)"), ("cuda", 1, 4, "has 1 visible GPU(s)"), ("cuda", 4, 8, "world_size=8"),
])
def test_device_resolution_table(requested, gpus, world_size, expected):
    if expected in ("cpu", "cuda"):
        assert resolve_device(requested, world_size, gpus=gpus) == expected
    else:
        with pytest.raises(ValueError, match=r"one GPU per rank.*" + expected.replace("(", r"\(").replace(")", r"\)")):
            resolve_device(requested, world_size, gpus=gpus)


@pytest.mark.parametrize("bad", ["gpu", "cuda:0", "CPU", 3, "mps"])
def test_bad_device_values_are_named(bad):
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or None, got " + repr(bad).replace("(", r"\(")):
        resolve_device(bad, 2, gpus=4)


def test_too_few_gpus_is_a_clear_error_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(device_model, "visible_gpus", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    forbid_starting_processes(monkeypatch)
    with pytest.raises(ValueError, match=r"world_size=4, but this machine has 1 visible GPU\(s\) "
                                         r"\(CUDA_VISIBLE_DEVICES=3\); use a smaller world_size or device='cpu'"):
        minidist.launch(lambda: 0, 4, device="cuda")


@pytest.mark.parametrize("device, backend, gpus, expected", [
    (None, None, 0, "cpu"), (None, None, 4, "cuda"), (None, "gloo", 4, "cpu"), ("cpu", "gloo", 4, "cpu"),
    (None, "nccl", 4, "cuda"), ("cuda", "nccl", 4, "cuda"), ("cpu", None, 4, "cpu"),
    ("cuda", "gloo", 4, "backend='gloo' means cpu ranks, but device='cuda'"),
    ("cpu", "nccl", 4, "backend='nccl' means cuda ranks, but device='cpu'"),
    (None, "nccl", 1, "one GPU per rank"),
    (None, "mpi", 4, "backend must be 'gloo', 'nccl' or None, got 'mpi'"),
    ("gpu", "gloo", 4, "device must be"),
])
def test_backend_and_device_combinations(monkeypatch, device, backend, gpus, expected):
    monkeypatch.setattr(device_model, "visible_gpus", lambda: gpus)
    if expected in ("cpu", "cuda"):
        assert launcher.resolve_kind(device, backend, 4) == expected
    else:
        with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
            launcher.resolve_kind(device, backend, 4)


def _where_am_i():
    return {"device": str(minidist.device()), "rank": dist.get_rank(),
            "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)}


def test_cpu_ranks_know_their_device_and_compute_in_true_fp32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True   # a forked rank inherits these
        out = minidist.launch(_where_am_i, 2, device="cpu", start_method="fork")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    assert out == [{"device": "cpu", "rank": r, "tf32": (False, False)} for r in range(2)]
    assert str(minidist.device()) == "cpu"      # the parent is no rank


def _return_a_state_dict():
    return torch.nn.Linear(2, 3, device=minidist.device()).state_dict()


def test_results_are_loaded_onto_the_cpu():
    # A result travels as bytes (minidist.runtime.plain_data): a rank on a GPU sends its tensors' bytes
    # and the parent builds CPU tensors, never initialising CUDA (which would forbid its next fork).
    [state] = minidist.launch(_return_a_state_dict, 1, device="cpu")
    assert state["weight"].device == torch.device("cpu") and state["weight"].shape == (3, 2)
    assert not torch.cuda.is_initialized()


def test_each_rank_destroys_its_process_group_after_returning(monkeypatch, tmp_path):
    real = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):     # runs in the (forked) rank
        rank = dist.get_rank()
        real(*args, **kwargs)
        (tmp_path / f"rank{rank}").write_text(str(dist.is_initialized()))

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    assert minidist.launch(lambda: dist.get_rank(), 3, start_method="fork") == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1", "rank2"]
    assert {(tmp_path / f).read_text() for f in os.listdir(tmp_path)} == {"False"}


def test_a_teardown_that_hangs_does_not_hold_the_launch(monkeypatch):
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: time.sleep(3600))
    monkeypatch.setattr(rank_process, "DESTROY_TIMEOUT", 0.2)
    start = time.monotonic()
    assert minidist.launch(lambda: dist.get_rank(), 2, start_method="fork", timeout=30) == [0, 1]
    assert time.monotonic() - start < 10


def test_the_launcher_never_initialises_cuda_in_the_parent(monkeypatch):
    def forbidden(*args):
        raise AssertionError("the parent asked the CUDA runtime (cudaGetDeviceCount initialises CUDA)")

    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", forbidden, raising=False)
    assert minidist.launch(lambda: str(minidist.device()), 2) == ["cpu", "cpu"]
    assert not torch.cuda.is_initialized() and not device_model.parent_initialised_cuda()


def _what_the_parent_set():
    return getattr(device_model, "_set_by_the_parent", None), _where_am_i()


def test_ranks_fork_unless_the_parent_initialised_cuda(monkeypatch):
    # A forked rank inherits what the parent set; a spawned one imports minidist afresh.
    monkeypatch.setattr(device_model, "_set_by_the_parent", "yes", raising=False)
    [(inherited, _)] = minidist.launch(_what_the_parent_set, 1)
    assert inherited == "yes"
    # As if NVML could not count and the CUDA runtime did: the parent's CUDA is initialised.
    monkeypatch.setattr(device_model, "_counted_with_cuda_runtime", True)
    assert device_model.parent_initialised_cuda()
    [(inherited, where)] = minidist.launch(_what_the_parent_set, 1)
    assert inherited is None
    assert where == {"device": "cpu", "rank": 0, "tf32": (False, False)}     # a spawned rank is set up too
    with pytest.raises(ValueError, match="start_method='fork' is unsafe here"):
        minidist.launch(_what_the_parent_set, 1, start_method="fork")


def test_doctor_skips_what_cannot_run_here_and_says_why(capsys, monkeypatch):
    from minidist.cli import main
    monkeypatch.setattr(device_model, "visible_gpus", lambda: 0)     # as on this CPU machine
    assert main(["doctor", "--json"]) == 0
    rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
    for name in ("launch 2 ranks (cpu, fork)", "launch 4 ranks (cpu, fork)", "launch 2 ranks (cpu, spawn)"):
        assert rows[name]["status"] == "PASS" and rows[name]["ok"], rows[name]
    for name in ("nccl backend", "launch 1 rank (cuda)", "launch 4 ranks (cuda)", "GPU suite, 1 GPU", "GPU suite, 4 GPUs"):
        assert rows[name]["status"] == "SKIP" and rows[name]["detail"], rows[name]
    assert "needs 4 GPU(s), 0 visible" in rows["GPU suite, 4 GPUs"]["detail"]
    assert "make test-gpu" in rows["GPU suite, 1 GPU"]["detail"]
    assert "docs/VERIFICATION.md: Time per lab" in rows["lab speed"]["detail"]


def test_doctor_names_only_what_a_students_folder_has(capsys, monkeypatch):
    """Installed from the student wheel (no checkout beside it): no GPU suite, no make target, and the
    lab speed row points at the student README's "Time per lab" section (which it has)."""
    from autograder.handout.student_dist import README
    from minidist.cli import doctor, main
    monkeypatch.setattr(device_model, "visible_gpus", lambda: 0)
    monkeypatch.setattr(doctor, "in_checkout", lambda: False)
    assert main(["doctor", "--json"]) == 0
    rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
    assert not [name for name in rows if "GPU suite" in name]
    assert not [r for r in rows.values() if "make " in r["detail"]], rows
    assert "the labs folder's README.md: Time per lab" in rows["lab speed"]["detail"]
    assert "\n## Time per lab\n" in README


def test_nccl_environment_makes_hangs_raise_and_keeps_what_the_user_set(monkeypatch):
    for key in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE",
                "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")         # a user who switched the recorder off
    device_model.prepare_nccl_environment("/tmp/x/rank")
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/x/rank"


def test_a_failure_report_names_the_rank_s_flight_recorder_dump(tmp_path):
    from minidist.runtime.failure_report import failure_report
    from minidist.runtime.rank_handle import RankHandle
    run_dir, dump_dir = tmp_path / "run", tmp_path / "dumps"
    run_dir.mkdir(), dump_dir.mkdir()
    handles = [RankHandle(r, str(run_dir), str(dump_dir)) for r in (1, 10)]
    for h in handles:
        with open(h.path("error"), "w") as f:
            f.write(f"rank {h.rank} raised: DistBackendError: timed out")
    (dump_dir / "rank10").write_text("a pickled trace")
    one, ten = (failure_report(h, 1.0, True) for h in handles)
    assert one == "rank 1 raised: DistBackendError: timed out"         # rank 10's dump is not rank 1's
    assert ten.endswith(f"NCCL flight recorder dump (its last collectives): {dump_dir / 'rank10'}")


@pytest.mark.parametrize("nvml_count, runtime_count, counted_with_runtime", [(4, 4, False), (-1, 2, True)])
def test_gpus_are_counted_by_nvml_and_a_runtime_count_marks_the_parent(monkeypatch, nvml_count, runtime_count,
                                                                       counted_with_runtime):
    # As on a CUDA build of torch on a GPU node: NVML counts without initialising CUDA; where
    # it cannot (MIG, no NVML library) torch asks the CUDA runtime, and forking is then unsafe.
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: nvml_count, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: runtime_count if nvml_count < 0 else nvml_count)
    monkeypatch.setattr(device_model, "_counted_with_cuda_runtime", False)
    assert device_model.visible_gpus() == runtime_count
    assert device_model.parent_initialised_cuda() is counted_with_runtime
