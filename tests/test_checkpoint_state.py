"""What a checkpoint must carry beyond weights and moments (issue 59): every random state a rank
draws from, the loss scaler's state, a load that reads (and verifies) only the bytes it needs,
and a restart loop that ends bit-identical to the uninterrupted run after a crash mid-step and
one mid-save."""
import json
import math
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from minidist import checkpoint as ckpt
from minidist.checkpoint.reads import runs
from minidist.harness import checkpoint as harness
from minidist.memory_techniques import DynamicLossScaler
from minidist.runtime import launch

STEPS, HALF = 4, 2
FP16 = ("ddp", "fp16")
NOISE = 0.05


# ----------------------------------------------------------------------------- random states
def _draws() -> dict:
    """The next numbers of every source, each generator's cached Gaussian included."""
    return {"torch": torch.rand(3, device="cpu").tolist(), "gauss": [random.gauss(0, 1) for _ in range(3)],
            "random": random.random(), "numpy": np.random.standard_normal(3).tolist()}


def _random_states_round_trip(root):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    random.gauss(0, 1), np.random.standard_normal()    # an odd number of draws: each caches a Gaussian
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    ckpt.save(root, ckpt.rng_state(0), 1)
    want = _draws()
    _draws()                                            # the streams move on
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    state = ckpt.rng_state(0)
    ckpt.load(os.path.join(root, "step_00000001"), state)
    return {"equal": _draws() == want, "loaded": sorted(p.key for p in state.load if p.loaded)}


def test_every_random_state_is_restored_bit_exactly(tmp_path):
    [out] = launch(_random_states_round_trip, 1, str(tmp_path))
    assert out["equal"]
    assert out["loaded"] == ["rng.rank0.cpu", "rng.rank0.numpy", "rng.rank0.python"]   # no CUDA here


def _a_rank_the_checkpoint_lacks_keeps_its_states(root):
    ckpt.save(root, ckpt.rng_state(0), 1)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    state = ckpt.rng_state(1)                           # a rank the 1-rank checkpoint did not have
    ckpt.load(os.path.join(root, "step_00000001"), state)
    return {"untouched": torch.equal(before[0], torch.random.get_rng_state()) and before[1] == random.getstate()
            and bool((before[2] == np.random.get_state()[1]).all()),
            "loaded": [p.key for p in state.load if p.loaded]}


def test_a_rank_the_checkpoint_has_no_states_for_keeps_its_own(tmp_path):
    [out] = launch(_a_rank_the_checkpoint_lacks_keeps_its_states, 1, str(tmp_path))
    assert out == {"untouched": True, "loaded": []}


def test_the_layout_holds_cuda_states_only_where_cuda_is():
    keys = lambda st: [p.key for p in st.save]      # noqa: E731
    assert keys(ckpt.rng_state(3, cuda=False, python=False, numpy=False)) == ["rng.rank3.cpu"]
    assert keys(ckpt.rng_state(0, cuda=False)) == ["rng.rank0.cpu", "rng.rank0.python", "rng.rank0.numpy"]
    with pytest.raises(ValueError, match="rank must be an int"):
        ckpt.rng_state(-1)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: test_cuda_random_states_round_trip covers it")
    assert keys(ckpt.rng_state(0, cuda=None)) == keys(ckpt.rng_state(0, cuda=False))
    with pytest.raises(ValueError, match="sees no CUDA device"):
        ckpt.rng_state(0, cuda=True)


class _FakeCudaGenerators:
    """Two devices' generator states (16 bytes each, as Philox's seed and offset), behind
    torch.cuda's RNG calls: what rng_state does with CUDA's states, without CUDA. It checks the
    bookkeeping (keys, per-device restore), not CUDA itself (test_cuda_random_states_round_trip)."""

    def __init__(self):
        self.states = [torch.full((16,), 10 + i, dtype=torch.uint8, device="cpu") for i in range(2)]

    def install(self, mp):
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 2)
        mp.setattr(torch.cuda, "get_rng_state", lambda i: self.states[i].clone())
        mp.setattr(torch.cuda, "set_rng_state", lambda t, i: self.states.__setitem__(i, t.clone()))


def _fake_cuda_round_trip(root):
    fake = _FakeCudaGenerators()
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        saved = ckpt.rng_state(dist.get_rank(), python=False, numpy=False)
        ckpt.save(root, saved, 1)
        fake.states = [torch.zeros(16, dtype=torch.uint8, device="cpu") for _ in range(2)]
        ckpt.load(os.path.join(root, "step_00000001"), ckpt.rng_state(dist.get_rank(), python=False, numpy=False))
        return {"keys": [p.key for p in saved.save], "states": [s.tolist() for s in fake.states]}


def test_cuda_states_are_saved_per_device_beside_the_cpu_one(tmp_path):
    out = launch(_fake_cuda_round_trip, 2, str(tmp_path), device="cpu")
    for r, o in enumerate(out):
        assert o["keys"] == [f"rng.rank{r}.cpu", f"rng.rank{r}.cuda0", f"rng.rank{r}.cuda1"]
        assert o["states"] == [[10] * 16, [11] * 16]        # each device got its own state back
    meta = ckpt.verify(str(tmp_path / "step_00000001"))
    assert all(s["rank"] == int(k.split(".")[1][4:]) for k, t in meta["tensors"].items() for s in t["shards"])


def _cuda_round_trip(root):
    torch.cuda.manual_seed_all(4)
    state = ckpt.rng_state(0, python=False, numpy=False)       # cuda=None: CUDA is initialised here
    ckpt.save(root, state, 1)
    want = torch.rand(5, device=minidist_device()).tolist()
    torch.cuda.manual_seed_all(8)
    ckpt.load(os.path.join(root, "step_00000001"), ckpt.rng_state(0, python=False, numpy=False))
    return {"equal": torch.rand(5, device=minidist_device()).tolist() == want, "keys": [p.key for p in state.save]}


def minidist_device():
    import minidist
    return minidist.device()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CUDA generators' states)")
def test_cuda_random_states_round_trip(tmp_path):
    [out] = launch(_cuda_round_trip, 1, str(tmp_path), device="cuda")
    assert out["equal"] and "rng.rank0.cuda0" in out["keys"]


# ----------------------------------------------------------------------------- the loss scaler
def test_a_restored_loss_scaler_continues_with_the_same_scale():
    a = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3)
    for found in (True, False, False, True, False):
        a.update(found)
    b = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))     # through a checkpoint's JSON extra
    assert (b.get_scale(), b.clean_steps, b.skipped) == (a.get_scale(), a.clean_steps, a.skipped) == (2.0 ** 8, 1, 2)
    for found in (False, False, True, False, False, False):
        a.update(found), b.update(found)
        assert b.get_scale() == a.get_scale()
    with pytest.raises(ValueError, match="another scaling policy"):
        DynamicLossScaler(growth_interval=5).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="has 'scale'"):
        b.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match="number > 0"):
        b.load_state_dict(dict(a.state_dict(), scale=-1.0))


# ----------------------------------------------------------------------------- reading only what is needed
@pytest.mark.parametrize("shape", [(5,), (4, 6), (3, 4, 5), ()])
def test_the_runs_of_a_box_are_exactly_its_elements(shape):
    gen = torch.Generator().manual_seed(0)
    flat = torch.arange(math.prod(shape)).view(shape)
    for _ in range(40):
        off = [int(torch.randint(0, s, (1,), generator=gen)) for s in shape]
        ln = [int(torch.randint(1, s - o + 1, (1,), generator=gen)) for s, o in zip(shape, off)]
        starts, run = runs(shape, off, ln)
        got = sorted(i for s in starts.tolist() for i in range(s, s + run))
        want = sorted(flat[tuple(slice(o, o + n) for o, n in zip(off, ln))].reshape(-1).tolist())
        assert got == want, (shape, off, ln)


A, B = (1024, 512), (64, 8192)          # A saved by columns, loaded by rows; B the other way round
CHUNK = 4096


def _full(name):
    shape = A if name == "a" else B
    return torch.randn(shape, generator=torch.Generator().manual_seed(len(name) + shape[0]), device="cpu")


def _cut(name, world, rank, dim):
    shape = A if name == "a" else B
    n = shape[dim] // world
    off = [0, 0]
    off[dim] = rank * n
    full = _full(name).to(minidist_device())
    return ckpt.Piece(name, full.narrow(dim, rank * n, n).contiguous(), shape, tuple(off))


def _save_cut(root):
    r, w = dist.get_rank(), dist.get_world_size()
    pieces = [_cut("a", w, r, 1), _cut("b", w, r, 0)]
    ckpt.save(root, ckpt.State(save=pieces), 1, chunk_bytes=CHUNK)


def _load_other_cut(root):
    r, w = dist.get_rank(), dist.get_world_size()
    targets = [_cut("a", w, r, 0), _cut("b", w, r, 1)]
    want = [p.tensor.clone() for p in targets]
    for p in targets:
        p.tensor.zero_()
    stats = {}
    ckpt.load(os.path.join(root, "step_00000001"), ckpt.State(load=targets), stats=stats)
    return {"equal": all(torch.equal(p.tensor, x) for p, x in zip(targets, want)), "stats": stats}


def test_a_reshard_from_4_to_2_ranks_reads_half_of_each_file(tmp_path):
    launch(_save_cut, 4, str(tmp_path))
    path = tmp_path / "step_00000001"
    sizes = {f: os.path.getsize(path / f) for f in os.listdir(path) if f.endswith(".safetensors")}
    out = launch(_load_other_cut, 2, str(tmp_path))
    for o in out:
        assert o["equal"]
        assert o["stats"]["by_file"].keys() == sizes.keys()         # every old file holds part of each box
        for f, n in o["stats"]["by_file"].items():
            assert 0.49 < n / sizes[f] < 0.52, (f, n, sizes[f])     # half of it, plus its header
        assert o["stats"]["bytes_read"] == sum(o["stats"]["by_file"].values())
    assert sum(o["stats"]["bytes_read"] for o in out) < 1.02 * sum(sizes.values())     # the checkpoint once


def _load_everything(root):
    full = ckpt.State(load=[ckpt.Piece(n, torch.zeros(s, device=minidist_device()), s, (0, 0)) for n, s in
                            (("a", A), ("b", B))])
    ckpt.load(os.path.join(root, "step_00000001"), full)
    return "loaded"


def _flip(path, name, at):
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        where = 8 + n + header[name]["data_offsets"][0] + at
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))


def test_a_load_verifies_the_bytes_it_reads(tmp_path):
    launch(_save_cut, 4, str(tmp_path))
    path = tmp_path / "step_00000001"
    # rank 3's piece of B holds rows 48-63: the second half of each of its rows is columns 4096-8191,
    # which only the second new rank reads. A flipped bit there passes the first rank's load.
    _flip(path / "rank00003.safetensors", "b@48,0", 4 * (8192 * 5 + 5000))
    with pytest.raises(Exception, match="rank00003.safetensors: bytes .* of b@48,0 differ from their CRC-32"):
        launch(_load_everything, 1, str(tmp_path))
    first = launch(_load_other_cut_or_error, 2, str(tmp_path))
    assert first[0] == {"equal": True}                              # read only its half: no error
    assert "CRC-32" in first[1]["error"]
    with pytest.raises(ckpt.CheckpointError, match="rank00003.safetensors: SHA-256"):
        ckpt.verify(str(path))                                      # the whole-file check still sees it


def _load_other_cut_or_error(root):
    try:
        return {"equal": _load_other_cut(root)["equal"]}
    except ckpt.CheckpointError as err:
        return {"error": str(err)}


# ----------------------------------------------------------------------------- the restart loop
@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp16"))
    launch(harness.train, 2, FP16, root, STEPS, every=HALF, noise=NOISE)
    return root


def _same_checkpoint(a: str, b: str) -> None:
    """Every rank's tensors (weights, masters, moments, step, random states) bit for bit, and extra."""
    from safetensors.torch import load_file
    ma, mb = ckpt.verify(a), ckpt.verify(b)
    assert ma["extra"] == mb["extra"] and ma["step"] == mb["step"]
    assert sorted(ma["files"]) == sorted(mb["files"])
    for f in ma["files"]:
        ta, tb = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f


def test_the_half_way_checkpoint_holds_state_a_fresh_run_lacks(fp16_run):
    extra = ckpt.read_metadata(os.path.join(fp16_run, "step_00000002"))["extra"]
    fresh = DynamicLossScaler(**harness.FP16_SCALER)
    assert extra["scaler"]["scale"] != fresh.get_scale() and extra["scaler"]["skipped"] > 0
    assert extra["sampler"]["position"] == HALF * harness.BATCH
    final = ckpt.read_metadata(os.path.join(fp16_run, "step_00000004"))["extra"]["scaler"]
    assert final["skipped"] < STEPS            # some steps updated the weights


@pytest.mark.parametrize("where", ["step", "save"])
def test_a_crash_mid_step_or_mid_save_restarts_bit_identical(where, tmp_path, fp16_run):
    root, marker = str(tmp_path / "ckpts"), str(tmp_path / "crash-once")
    open(marker, "w").close()
    failures = []
    out = launch(harness.train, 2, FP16, root, STEPS, every=HALF, noise=NOISE, crash_at=(1, 3, where),
                 crash_marker=marker, max_restarts=1, on_restart=lambda attempt, err: failures.append(str(err)))
    assert len(failures) == 1 and "rank 1" in failures[0] and not os.path.exists(marker)
    assert [o["start"] for o in out] == [HALF, HALF]
    _same_checkpoint(os.path.join(root, "step_00000004"), os.path.join(fp16_run, "step_00000004"))


def test_without_its_random_states_the_same_resume_differs(tmp_path, fp16_run):
    """What the states are for: the step-2 checkpoint with its rng.* tensors dropped from the
    metadata resumes from freshly seeded generators, and ends elsewhere."""
    root = tmp_path / "ckpts"
    shutil.copytree(os.path.join(fp16_run, "step_00000002"), root / "step_00000002")
    meta_path = root / "step_00000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["tensors"] = {k: t for k, t in meta["tensors"].items() if not k.startswith("rng.")}
    meta_path.write_text(json.dumps(meta))
    launch(harness.train, 2, FP16, str(root), STEPS, every=HALF, noise=NOISE)
    want = harness.full_state(os.path.join(fp16_run, "step_00000004"), FP16)
    got = harness.full_state(str(root / "step_00000004"), FP16)
    assert not all(torch.equal(got[k], want[k]) for k in want)
