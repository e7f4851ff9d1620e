"""3D parallelism (minidist.mesh): the rank grid, and DP × PP × TP training against one process.

One 8-rank launch trains every layout below for 3 steps (fp32, SGD with momentum) and is
held against: single-process TinyGPT's losses and final weights (1e-5), torch's own mesh
groups, the traced traffic per axis = cost.parallel3d exactly in (op, bytes), model states
exactly and saved activations (the executor's ActivationMeter) within 5% of the model.
"""
import pytest
import torch

from minidist.cost.parallel3d import memory_per_rank, stage_numel, step_collectives
from minidist.harness.parallel3d import TINY, Layout, run_layouts
from minidist.mesh import Trainer3D, check_3d, coordinate, innermost_contiguous, mesh_groups, rank_grid
from minidist.models import TinyGPT
from minidist.runtime import launch
from minidist.trace import trace

LAYOUTS = [Layout(2, 2, 2, "1f1b", 2), Layout(1, 2, 4, "gpipe", 4), Layout(2, 4, 1, "1f1b", 4),
           Layout(4, 1, 2, "gpipe", 2), Layout(2, 2, 2, "1f1b", 2, sequence_parallel=True)]
TOL = 1e-5


@pytest.fixture(scope="module")
def rows():
    return run_layouts(LAYOUTS, TINY, steps=3, batch=8, dtype=torch.float32, optimizer="sgd", lr=0.1)


# ----------------------------------------------------------------------------- the grid, no process
def test_mesh_groups_of_a_2x2x2_mesh():
    g = mesh_groups(8, 2, 2, 2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert coordinate(6, 2, 2, 2) == (1, 1, 0)


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (1, 2, 4), (2, 4, 1), (4, 1, 2), (3, 2, 2)])
def test_every_rank_is_in_exactly_one_group_per_axis(dp, pp, tp):
    n = dp * pp * tp
    for axis, size in zip(("dp", "pp", "tp"), (dp, pp, tp)):
        groups = mesh_groups(n, dp, pp, tp)[axis]
        assert sorted(r for g in groups for r in g) == list(range(n))
        assert all(len(g) == size for g in groups)


def test_innermost_axis_is_contiguous_and_a_strided_one_is_caught():
    assert innermost_contiguous(mesh_groups(32, 2, 4, 4)["tp"], gpus_per_node=8)
    assert not innermost_contiguous([[0, 2], [1, 3]])                  # TP strided across the grid
    assert not innermost_contiguous([[6, 7, 8, 9]], gpus_per_node=8)   # consecutive but over two nodes
    grid = rank_grid(2, 2, 2, gpus_per_node=4)
    assert "6     (1, 1, 0)     1     [2, 6]    [4, 6]    [6, 7]" in grid
    assert grid.endswith("inside one node: yes")


@pytest.mark.parametrize("kw,words", [
    (dict(dp=3, pp=2, tp=2, world=8), "holds 12 ranks"),
    (dict(dp=1, pp=3, tp=2), "do not split into pp=3"),
    (dict(dp=1, pp=1, tp=8), "n_heads=4 is not divisible by tp=8"),
    (dict(dp=2, pp=2, tp=2, micro_batches=3), "does not split into dp=2"),
    (dict(dp=1, pp=4, tp=2, schedule="interleaved", micro_batches=2), "multiple of p"),
])
def test_bad_layouts_raise_before_any_rank_communicates(kw, words):
    kw = dict(batch=8, micro_batches=2, schedule="1f1b") | kw
    world = kw.pop("world", kw["dp"] * kw["pp"] * kw["tp"])
    with pytest.raises(ValueError, match=words):
        check_3d(TINY, world, **kw)


# ----------------------------------------------------------------------------- one launch, every layout
def test_losses_and_final_weights_equal_one_process(rows):
    for row in rows:
        assert row["loss_err"] <= TOL and row["weight_err"] <= TOL, row


def test_torch_mesh_groups_equal_mesh_groups(rows):
    assert all(row["groups_equal"] for row in rows)


def test_traced_bytes_per_axis_equal_the_cost_model(rows):
    for row in rows:
        assert row["traffic_equal"], row
    by = {row["layout"]: row["bytes_by_axis"] for row in rows}
    assert by["2x4x1 1f1b m=4"]["tp"] == (0, 0) and by["1x2x4 gpipe m=4"]["dp"] == (0, 0)
    sp, plain = by["2x2x2 1f1b m=2 +SP"]["pp"], by["2x2x2 1f1b m=2"]["pp"]
    assert sp[0] < plain[0]                       # SP sends (b, s/t, h) shards between stages


def test_memory_model_states_exact_activations_within_5_percent(rows):
    for row in rows:
        assert row["model_states_equal"], row["model_states"]
        assert row["activation_rel_err"] <= 0.05, row["activations"]
    gpipe = next(r for r in rows if r["layout"] == "1x2x4 gpipe m=4")["activations"]
    onefb = next(r for r in rows if r["layout"] == "2x4x1 1f1b m=4")["activations"]
    assert len({a for a, _ in gpipe[:4]}) == 1               # GPipe: every stage-0 TP rank holds m micro-batches
    assert onefb[0][0] > onefb[1][0] > onefb[2][0]           # 1F1B: stage k holds p - k


def _bad_trainer():
    with trace() as t:
        try:
            Trainer3D(TinyGPT(TINY), 2, 2, 2, batch=8, micro_batches=2)
        except ValueError as err:
            return str(err), len(t.comm())
    return None, len(t.comm())


def test_trainer_refuses_a_wrong_mesh_without_communicating():
    out = launch(_bad_trainer, 4, timeout=60)
    assert all("holds 8 ranks" in msg and n == 0 for msg, n in out), out


# ----------------------------------------------------------------------------- the formulas alone
def test_stage_numel_adds_up_to_the_model():
    total = sum(p.numel() for p in TinyGPT(TINY).parameters())
    assert sum(stage_numel(TINY, 2, 1, s) for s in range(2)) == total
    assert stage_numel(TINY, 1, 1, 0) == total


def test_cost_model_pieces():
    coll = step_collectives(TINY, 2, 2, 2, 0, batch=8, micro_batches=2)
    assert [c.op for c in coll["pp"]].count("isend") == 2 and coll["dp"][0].nbytes == 4 * stage_numel(TINY, 2, 2, 0)
    one = memory_per_rank(TINY, 1, 2, 1, 0, batch=8, micro_batches=4, schedule="gpipe")
    fb = memory_per_rank(TINY, 1, 2, 1, 0, batch=8, micro_batches=4, schedule="1f1b")
    assert one["activations"] == 2 * fb["activations"]       # GPipe keeps m = 4, 1F1B's stage 0 keeps p = 2
    rc = memory_per_rank(TINY, 1, 2, 1, 0, batch=8, micro_batches=4, recompute=True)
    assert rc["activations"] < fb["activations"]
