"""Distributed checkpoints (minidist.checkpoint): boxes, resharding round trips against an
uninterrupted run, torch DCP as the reference, torn checkpoints refused, crashes survived."""
import json
import math
import os
import shutil

import pytest
import torch

from minidist import checkpoint as ckpt
from minidist.checkpoint.sampler import ResumableSampler
from minidist.harness import checkpoint as harness
from minidist.runtime import LaunchError, launch

STEPS, HALF = 4, 2


def rel_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / max(b[k].norm(), 1e-30)) for k in a)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), ()])
def test_flat_ranges_are_unions_of_contiguous_boxes(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).view(shape)
    for a in range(numel + 1):
        for b in range(a, numel + 1):
            got = torch.cat([full[tuple(slice(o, o + n) for o, n in zip(off, ln))].reshape(-1)
                             for off, ln in ckpt.flat_range_boxes(shape, a, b)] or [torch.empty(0, dtype=torch.long)])
            assert got.tolist() == list(range(a, b)), (shape, a, b)
            assert len(ckpt.flat_range_boxes(shape, a, b)) <= max(1, 2 * len(shape) - 1)


def _uninterrupted(tmp_path_factory, spec, n):
    root = str(tmp_path_factory.mktemp("full"))
    launch(harness.train, n, spec, root, STEPS, every=HALF)
    return root


def _resume(root_full, tmp_path, spec, n):
    """The uninterrupted run's step-2 checkpoint, resumed under ``spec`` on ``n`` ranks to the end."""
    root = str(tmp_path / "resumed")
    os.makedirs(root)
    shutil.copytree(os.path.join(root_full, "step_00000002"), os.path.join(root, "step_00000002"))
    out = launch(harness.train, n, spec, root, STEPS, every=HALF)
    assert all(o["start"] == HALF for o in out)
    return os.path.join(root, "step_00000004")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, ("zero", 3), 4)


@pytest.mark.parametrize("src,dst", [
    ((("zero", 3), 4), (("ddp",), 2)),              # ZeRO-3 on 4 ranks -> DDP on 2
    ((("3d", 2, 1, 2), 4), (("3d", 4, 1, 1), 4)),   # TP 2 x DP 2 -> TP 1 x DP 4
    ((("3d", 2, 2, 1), 4), (("3d", 2, 1, 1), 2)),   # PP 2 x DP 2 -> PP 1 x DP 2
], ids=["zero3x4-ddp2", "tp2dp2-tp1dp4", "pp2dp2-pp1dp2"])
def test_resharded_resume_equals_the_uninterrupted_run(src, dst, tmp_path, tmp_path_factory, zero3_run):
    (s_spec, s_n), (d_spec, d_n) = src, dst
    full = zero3_run if s_spec == ("zero", 3) else _uninterrupted(tmp_path_factory, s_spec, s_n)
    resumed = _resume(full, tmp_path, d_spec, d_n)
    want = harness.full_state(os.path.join(full, "step_00000004"), s_spec)
    got = harness.full_state(resumed, d_spec)
    assert rel_err(got, want) <= 1e-6
    assert got["optim.step"].item() == STEPS


def test_same_layout_resume_is_bit_identical(tmp_path, zero3_run):
    resumed = _resume(zero3_run, tmp_path, ("zero", 3), 4)
    want = harness.full_state(os.path.join(zero3_run, "step_00000004"), ("zero", 3))
    got = harness.full_state(resumed, ("zero", 3))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_each_rank_writes_its_shard_and_the_metadata_tiles_every_tensor(zero3_run):
    meta = ckpt.verify(os.path.join(zero3_run, "step_00000004"))
    assert sorted(f["rank"] for f in meta["files"].values()) == [0, 1, 2, 3]
    for key, t in meta["tensors"].items():
        assert sum(math.prod(s["lengths"]) for s in t["shards"]) == math.prod(t["shape"]), key
    # ZeRO-3: each FSDP unit (a Linear) is a padded flat buffer of parameters, and Adam's two moments
    # likewise; rank r writes its slice of each (padding is never saved), rank 0 the step too.
    from minidist.cost.checkpoint import flat_shard_elements
    units = [91, 182, 182, 182, 70]         # TinyMLP's Linears: 6*13+13, 3 x (13*13+13), 13*5+5
    for r in range(4):
        written = sum(math.prod(s["lengths"]) for t in meta["tensors"].values() for s in t["shards"] if s["rank"] == r)
        assert written == 3 * sum(flat_shard_elements(u, 4, r) for u in units) + (r == 0), r


def _damaged_copy(src, dst, how):
    shutil.copytree(src, dst)
    if how == "no-metadata":
        os.remove(os.path.join(dst, "metadata.json"))
    elif how == "truncated":
        path = os.path.join(dst, "rank00001.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 8)
    elif how == "corrupted":
        path = os.path.join(dst, "rank00002.safetensors")
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0xFF
        open(path, "wb").write(bytes(data))
    elif how == "foreign":
        with open(os.path.join(dst, "metadata.json"), "w") as f:
            json.dump({"format": "someone-else/3"}, f)


@pytest.mark.parametrize("how,says", [("no-metadata", "metadata.json is missing"),
                                      ("truncated", "rank00001.safetensors has"),
                                      ("corrupted", "rank00002.safetensors: SHA-256"),
                                      ("foreign", "not a minidist checkpoint")])
def test_a_damaged_checkpoint_is_refused_and_the_last_good_one_is_found(how, says, tmp_path, zero3_run):
    root = tmp_path / "ckpts"
    shutil.copytree(os.path.join(zero3_run, "step_00000002"), root / "step_00000002")
    _damaged_copy(os.path.join(zero3_run, "step_00000004"), root / "step_00000004", how)
    with pytest.raises(ckpt.CheckpointError, match=says):
        ckpt.verify(str(root / "step_00000004"))
    with pytest.raises(ckpt.CheckpointError, match=says.split(":")[0]):
        harness.full_state(str(root / "step_00000004"), ("zero", 3))
    assert ckpt.latest(str(root)) == str(root / "step_00000002")


@pytest.mark.parametrize("where", ["step", "save"])
def test_a_crash_mid_step_or_mid_save_restarts_and_ends_equal(where, tmp_path, zero3_run):
    root, marker = str(tmp_path / "ckpts"), str(tmp_path / "crash-once")
    open(marker, "w").close()
    failures = []

    def on_restart(attempt, err):
        failures.append(str(err))
        if where == "save":     # the save of step 4 was torn: step 2 is still the newest good one
            assert ckpt.latest(root).endswith("step_00000002")
            assert any(d.startswith(".tmp-step_00000004") for d in os.listdir(root))

    out = launch(harness.train, 4, ("zero", 3), root, STEPS, every=HALF, crash_at=(1, 3, where),
                 crash_marker=marker, max_restarts=1, on_restart=on_restart)
    assert len(failures) == 1 and "rank 1" in failures[0]
    assert all(o["start"] == HALF for o in out)        # the restart resumed from step 2
    want = harness.full_state(os.path.join(zero3_run, "step_00000004"), ("zero", 3))
    got = harness.full_state(os.path.join(root, "step_00000004"), ("zero", 3))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not any(d.startswith(".tmp-") for d in os.listdir(root))


def test_restarts_are_bounded_and_the_last_failure_is_raised():
    def always_fails():
        raise RuntimeError("boom")
    seen = []
    with pytest.raises(LaunchError, match="boom"):
        launch(always_fails, 2, max_restarts=2, on_restart=lambda a, e: seen.append(a))
    assert seen == [1, 2]
    with pytest.raises(ValueError, match="max_restarts"):
        launch(always_fails, 2, max_restarts=-1)


def test_the_sampler_resumes_the_same_order():
    a = ckpt_sampler()
    first = [a.next_batch() for _ in range(9)]
    b = ckpt_sampler()
    for _ in range(4):
        b.next_batch()
    c = ckpt_sampler()
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(first[4:], [c.next_batch() for _ in range(5)]))
    with pytest.raises(ValueError, match="cannot be resumed"):
        ResumableSampler(48, 4).load_state_dict(b.state_dict())


def ckpt_sampler():
    return ResumableSampler(20, 6, seed=5)       # 3 batches an epoch: 9 batches cross two epochs


# ----------------------------------------------------------------------------- torch DCP as the reference
def _dcp_layout(state_full: dict, placements_of, mesh):
    from torch.distributed.tensor import distribute_tensor
    return {k: distribute_tensor(v, mesh, placements_of(k, v)) for k, v in state_full.items()}


def _placements_a(key, t):
    from torch.distributed.tensor import Replicate, Shard
    return [Shard(0)] if t.dim() == 2 else [Replicate()]        # rows of every matrix, vectors replicated


def _placements_b(key, t):
    from torch.distributed.tensor import Shard
    return [Shard(t.dim() - 1)]                                 # columns of matrices, pieces of vectors


def _full_gpt_state():
    from minidist.models import GPTConfig, TinyGPT
    model = TinyGPT(GPTConfig(vocab=32, d_model=16, n_heads=4, n_layers=1, seq_len=8), device="cpu")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save_both(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = _dcp_layout(_full_gpt_state(), _placements_a, mesh)
    dcp.save(state, checkpoint_id=os.path.join(root, "dcp"))
    ckpt.save(os.path.join(root, "ours"), ckpt.dtensors(state), 0)


def _load_both(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _full_gpt_state()
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    by_dcp, by_us = _dcp_layout(zeros, _placements_b, mesh), _dcp_layout(zeros, _placements_b, mesh)
    dcp.load(by_dcp, checkpoint_id=os.path.join(root, "dcp"))
    ckpt.load(os.path.join(root, "ours", "step_00000000"), ckpt.dtensors(by_us))
    want = _dcp_layout(full, _placements_b, mesh)
    return {"same_as_dcp": all(torch.equal(by_us[k].to_local(), by_dcp[k].to_local()) for k in full),
            "right_values": all(torch.equal(by_us[k].to_local(), want[k].to_local()) for k in full),
            "shards": len(by_us), "local_elements": sum(t.to_local().numel() for t in by_us.values())}


def test_dcp_is_the_reference_saved_on_4_loaded_on_2_under_another_sharding(tmp_path):
    launch(_save_both, 4, str(tmp_path))
    out = launch(_load_both, 2, str(tmp_path))
    full = _full_gpt_state()
    assert all(o["same_as_dcp"] and o["right_values"] for o in out), out
    assert sum(o["local_elements"] for o in out) == sum(v.numel() for v in full.values())


def test_our_safetensors_writer_is_read_by_safetensors(tmp_path):
    from safetensors.torch import load_file
    from minidist.checkpoint.save import write_safetensors
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "s": torch.tensor(2.5),
               "h": torch.randn(4, dtype=torch.bfloat16), "u": torch.randint(0, 255, (9,), dtype=torch.uint8)}
    write_safetensors(str(tmp_path / "x.safetensors"), tensors, {"k": "v"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_a_restart_on_fewer_ranks_reshards_and_ends_equal(tmp_path, zero3_run):
    """A node is lost: the job comes back on 2 ranks instead of 4 and resumes from the 4-rank checkpoint."""
    root, marker = str(tmp_path / "ckpts"), str(tmp_path / "crash-once")
    open(marker, "w").close()
    out = launch(harness.train, 4, ("zero", 3), root, STEPS, every=HALF, crash_at=(1, 3, "step"),
                 crash_marker=marker, max_restarts=1, on_restart=lambda attempt, err: 2)
    assert len(out) == 2 and all(o["start"] == HALF for o in out)
    want = harness.full_state(os.path.join(zero3_run, "step_00000004"), ("zero", 3))
    got = harness.full_state(os.path.join(root, "step_00000004"), ("zero", 3))
    assert rel_err(got, want) <= 1e-6


def _rng_round_trip(root):
    state = ckpt.rng_state(0)
    ckpt.save(root, state, 1)
    first = torch.rand(4)
    ckpt.load(os.path.join(root, "step_00000001"), ckpt.rng_state(0))
    return torch.equal(first, torch.rand(4))


def test_the_random_state_is_part_of_the_checkpoint(tmp_path):
    assert launch(_rng_round_trip, 1, str(tmp_path)) == [True]


def test_async_saves_give_the_same_checkpoints_as_blocking_ones(tmp_path, zero3_run):
    root = str(tmp_path / "async")
    launch(harness.train, 4, ("zero", 3), root, STEPS, every=HALF, blocking=False)
    for step in ("step_00000002", "step_00000004"):
        want = harness.full_state(os.path.join(zero3_run, step), ("zero", 3))
        got = harness.full_state(os.path.join(root, step), ("zero", 3))
        assert all(torch.equal(got[k], want[k]) for k in want)
