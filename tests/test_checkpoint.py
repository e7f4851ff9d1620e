"""Distributed checkpoints (minidist.checkpoint): boxes, resharding round trips against an
uninterrupted run, torch DCP as the reference, torn checkpoints refused, crashes survived; the
portable format (lab 10's) written, read under another layout, refused when damaged, exported to."""
import hashlib
import json
import math
import os
import shutil

import pytest
import torch

from minidist import checkpoint as ckpt
from minidist.checkpoint import portable
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
        written = sum(math.prod(s["lengths"]) for k, t in meta["tensors"].items() for s in t["shards"]
                      if s["rank"] == r and not k.startswith("rng."))
        assert written == 3 * sum(flat_shard_elements(u, 4, r) for u in units) + (r == 0), r
        # and its own random states, which only it writes (CPU torch, Python, numpy on CPU ranks)
        assert {k for k in meta["tensors"] if k.startswith(f"rng.rank{r}.")} == {
            f"rng.rank{r}.{s}" for s in ("cpu", "python", "numpy")}
        assert all(s["rank"] == r for k, t in meta["tensors"].items() if k.startswith(f"rng.rank{r}.")
                   for s in t["shards"])


def _damaged_copy(src, dst, how):
    shutil.copytree(src, dst)
    if how == "no-metadata":
        os.remove(os.path.join(dst, "metadata.json"))
    elif how == "truncated":
        path = os.path.join(dst, "rank00001.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 8)
    elif how == "corrupted":            # one byte of a model piece (what a load reads, not only verify)
        path = os.path.join(dst, "rank00002.safetensors")
        data = bytearray(open(path, "rb").read())
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        name = next(k for k in header if k.startswith("hidden.1.weight@"))
        data[8 + n + header[name]["data_offsets"][0] + 2] ^= 0xFF
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


# ----------------------------------------------------------------------------- the portable format (lab 10's)

PORTABLE_STATE = {"emb.weight": (7, 5), "proj.weight": (5, 3), "proj.bias": (5,), "step": (1,)}


def _portable_state(dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for k, shape in PORTABLE_STATE.items()}


def _split_piece(t: torch.Tensor, layout: dict, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece by torch.tensor_split, the definition the layouts follow."""
    if layout["kind"] == "replicated" or t.dim() == 0:
        return t
    dim = 0 if layout["kind"] == "rows" else t.dim() - 1
    return torch.tensor_split(t, layout["world"], dim=dim)[rank]


@pytest.mark.parametrize("saved,loaded,dtype", [
    ({"kind": "rows", "world": 4}, {"kind": "cols", "world": 3}, torch.float32),
    ({"kind": "cols", "world": 3}, {"kind": "replicated", "world": 2}, torch.float64),
    ({"kind": "replicated", "world": 2}, {"kind": "rows", "world": 3}, torch.bfloat16),
    ({"kind": "rows", "world": 8}, {"kind": "rows", "world": 2}, torch.float32),       # ranks 5-7 hold no row of 5
])
def test_portable_save_writes_each_owners_box_and_loads_under_another_layout(saved, loaded, dtype, tmp_path):
    from safetensors.torch import load_file
    state = _portable_state(dtype) | {"scale": torch.tensor(0.5, dtype=dtype)}
    path = str(tmp_path / "step_1")
    assert portable.save_portable(state, saved, path) == path
    assert sorted(os.listdir(tmp_path)) == ["step_1"]                   # the temporary directory renamed
    meta = json.load(open(os.path.join(path, "metadata.json")))
    for name, t in state.items():
        entry = meta["tensors"][name]
        assert entry["shape"] == list(t.shape) and entry["dtype"] == str(dtype).removeprefix("torch.")
        owners = [0] if saved["kind"] == "replicated" or t.dim() == 0 else range(saved["world"])
        want = [(r, _split_piece(t, saved, r)) for r in owners if _split_piece(t, saved, r).numel()]
        assert [s["rank"] for s in entry["shards"]] == [r for r, _ in want], name
        for s, (r, piece) in zip(entry["shards"], want):
            assert s["file"] == f"rank{r}.safetensors" and s["lengths"] == list(piece.shape)
            assert torch.equal(load_file(os.path.join(path, s["file"]))[name], piece), (name, r)
    assert sorted(meta["files"]) == sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    for f, rec in meta["files"].items():
        assert rec == {"bytes": os.path.getsize(os.path.join(path, f)),
                       "sha256": hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()}
    for r in range(loaded["world"]):
        got = portable.load_portable(path, loaded, r)
        assert got.keys() == state.keys()
        assert all(torch.equal(got[k], _split_piece(state[k], loaded, r)) for k in state), r


def test_portable_save_is_atomic_and_never_overwrites(tmp_path, monkeypatch):
    path, written = str(tmp_path / "step_2"), []

    def disk_fills_up(file, tensors, metadata):            # the second rank's file: the disk is full
        if written:
            raise OSError(28, "No space left on device")
        written.append(file)
        write_safetensors(file, tensors, metadata)
    write_safetensors = portable.write_safetensors
    monkeypatch.setattr(portable, "write_safetensors", disk_fills_up)
    with pytest.raises(OSError, match="No space"):
        portable.save_portable(_portable_state(), {"kind": "rows", "world": 2}, path)
    assert written and os.listdir(tmp_path) == []            # no torn step_2, no temporary left
    monkeypatch.undo()
    portable.save_portable(_portable_state(), {"kind": "rows", "world": 2}, path)
    with pytest.raises(FileExistsError, match="step_2 exists"):
        portable.save_portable(_portable_state(), {"kind": "rows", "world": 2}, path)
    with pytest.raises(ValueError, match="a layout is"):
        portable.save_portable(_portable_state(), {"kind": "diagonal", "world": 2}, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        portable.layout_box((4, 4), {"kind": "rows", "world": 0}, 0)


@pytest.mark.parametrize("how,says", [("torn", "metadata.json is missing"), ("garbled", "not valid JSON"),
                                      ("truncated", "rank1.safetensors has"), ("corrupted", "rank0.safetensors: SHA-256")])
def test_a_damaged_portable_checkpoint_is_refused(how, says, tmp_path):
    path = str(tmp_path / "step_3")
    portable.save_portable(_portable_state(), {"kind": "rows", "world": 2}, path)
    portable.verify_portable(path)
    if how == "torn":
        os.remove(os.path.join(path, "metadata.json"))
    elif how == "garbled":
        open(os.path.join(path, "metadata.json"), "w").write('{"tensors": {')
    elif how == "truncated":
        f = os.path.join(path, "rank1.safetensors")
        os.truncate(f, os.path.getsize(f) - 4)
    else:
        f = os.path.join(path, "rank0.safetensors")
        data = bytearray(open(f, "rb").read())
        data[-2] ^= 0xFF
        open(f, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=says):
        portable.verify_portable(path)
    with pytest.raises(ckpt.CheckpointError, match=says):
        portable.load_portable(path, {"kind": "cols", "world": 2}, 1)


def test_a_minidist_checkpoint_exports_to_the_portable_format(tmp_path, zero3_run):
    native = os.path.join(zero3_run, "step_00000004")
    path = portable.export_portable(native, str(tmp_path / "step_4"), {"kind": "rows", "world": 3})
    want = harness.full_state(native, ("zero", 3))       # the native checkpoint, loaded into one process's model
    full = portable.load_portable(path, {"kind": "replicated", "world": 1}, 0)
    assert want.keys() <= full.keys() and all(torch.equal(full[k], want[k]) for k in want)
    assert sorted(f for f in os.listdir(path)) == ["metadata.json"] + [f"rank{r}.safetensors" for r in range(3)]
