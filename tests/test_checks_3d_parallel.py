"""Lab 7's checks catch its classic mistakes: strided TP groups, gradients not divided by d, 1F1B's
activations counted as GPipe's; library answers (minidist.mesh's own mesh_groups and Trainer3D, the
cost model inside predict_memory) are refused. The correct alternatives the lab allows (a mesh built
by reshaping torch.arange, a step that all-reduces gradients one parameter at a time and reports the
loss by broadcast, a memory model that rounds ZeRO's shards up, ...) live in the bug bank
(solutions/lab7_3d_parallel/bugbank.py, ALTERNATIVES), where the selftest grades them as submissions;
the helpers below build the mistakes from them."""
import math

import pytest
import torch
import torch.distributed as dist

from minidist.checks import lab7_3d_parallel as lab7
from minidist.cost.parallel3d import stage_activation_bytes
from minidist.models import local_slice
from minidist.pipeline import make, run_schedule


def mesh_by_reshape(world_size, dp, pp, tp):
    if dp * pp * tp != world_size:
        raise ValueError("the mesh does not hold the world")
    grid = torch.arange(world_size).view(dp, pp, tp)
    # move the axis last, flatten the others in row-major order: one row per group
    return {"dp": grid.permute(1, 2, 0).reshape(-1, dp).tolist(),
            "pp": grid.permute(0, 2, 1).reshape(-1, pp).tolist(),
            "tp": grid.reshape(-1, tp).tolist()}


def mesh_tp_strided(world_size, dp, pp, tp):
    groups = mesh_by_reshape(world_size, dp, pp, tp)
    groups["tp"] = torch.arange(world_size).view(tp, dp * pp).t().tolist()
    return groups


def step_per_parameter(stage, optimizer, ids, targets, mesh, micro_batches, schedule="1f1b", divide=True):
    dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
    dp, pp = dist.get_world_size(dp_group), dist.get_world_size(pp_group)
    i_dp = mesh.get_local_rank("dp")
    ids, targets = local_slice(ids, i_dp, dp), local_slice(targets, i_dp, dp)
    optimizer.zero_grad()
    stats = run_schedule(make(schedule, pp, micro_batches), [stage], ids if stage.first else None,
                         targets if stage.last else None, stage.loss,
                         act_shape=stage.activation_shape(ids.shape[0] // micro_batches, ids.shape[1]), group=pp_group)
    for p in stage.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        if divide:
            p.grad /= dp
    optimizer.step()
    loss = torch.tensor(stats.loss if stage.last else 0.0)
    dist.broadcast(loss, src=dist.get_global_rank(pp_group, pp - 1), group=pp_group)
    dist.all_reduce(loss, group=dp_group)
    return loss.item() / dp


def step_sum_not_mean(*args):
    return step_per_parameter(*args, divide=False)


def step_library(stage, optimizer, ids, targets, mesh, micro_batches, schedule="1f1b"):
    from minidist.mesh import Trainer3D
    Trainer3D.reduce_gradients(None)


def memory_rounding_up(c, gpipe_everywhere=False):
    h, f, v, t, b = c.cfg.d_model, c.cfg.d_ff, c.cfg.vocab, c.tp, int(c.cfg.bias)
    kv = c.cfg.n_kv_heads * c.cfg.head_dim
    layer = 4 * h + (h + b) * (h + 2 * kv + f) // t + (h * h + f * h) // t + 2 * b * h
    n = c.cfg.n_layers // c.pp * layer + (v // t * h + c.cfg.seq_len * h if c.stage == 0 else 0) \
        + (2 * h + v // t * h if c.stage == c.pp - 1 else 0)
    e, k = c.elem_bytes, {"adam": 2, "sgd": 1}[c.optimizer] * c.elem_bytes
    sharded = lambda numel, z: math.ceil(numel / c.dp) if c.zero_stage >= z else numel   # noqa: E731
    out = {"params": sharded(n, 3) * e, "grads": sharded(n, 2) * e, "optimizer": sharded(n, 1) * k}
    flight = c.micro_batches if gpipe_everywhere or c.schedule == "gpipe" else min(c.pp - c.stage, c.micro_batches)
    out["activations"] = flight * stage_activation_bytes(c.cfg, c.batch // (c.dp * c.micro_batches), c.pp, c.tp,
                                                         c.stage, elem_bytes=e)
    out["total"] = sum(out.values())
    return out


def test_strided_tp_groups_fail():
    with pytest.raises(AssertionError, match="TP groups"):
        lab7.check_mesh_groups(mesh_tp_strided)


def test_mesh_sizes_must_be_positive_integers(capsys):
    lab7.check_mesh_groups(mesh_by_reshape)                 # visible: only a product that does not match
    assert "\u2713 mesh_groups: " in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"dp=-2.*the lab asks for ValueError"):
        lab7.check_mesh_groups(mesh_by_reshape, hidden=True)


def stage_numel_without_gqa(cfg, pp, tp, stage):
    h, f, v, t, b = cfg.d_model, cfg.d_ff, cfg.vocab, tp, int(cfg.bias)
    n = cfg.n_layers // pp * (4 * h + (h + b) * (3 * h + f) // t + (h * h + f * h) // t + 2 * b * h)
    return n + (v // t * h + cfg.seq_len * h if stage == 0 else 0) + (2 * h + v // t * h if stage == pp - 1 else 0)


def test_stage_parameters_has_its_own_test():
    lab7.check_stage_parameters(stage_numel_without_gqa)    # no GQA among the visible configs
    with pytest.raises(AssertionError, match="n_kv_heads=2"):
        lab7.check_stage_parameters(stage_numel_without_gqa, hidden=True)


def step_always_1f1b(stage, optimizer, ids, targets, mesh, micro_batches, schedule="1f1b"):
    return step_per_parameter(stage, optimizer, ids, targets, mesh, micro_batches, "1f1b")


def test_train_step_runs_the_schedule_it_was_given():
    with pytest.raises(AssertionError, match=r"gpipe.*F0 F1 B0 B1"):
        lab7.check_train_step_3d(step_always_1f1b)


def test_predict_memory_gpipe_count_fails():
    with pytest.raises(AssertionError, match="activations"):
        lab7.check_predict_memory(lambda c: memory_rounding_up(c, gpipe_everywhere=True))


def test_train_step_without_dividing_by_dp_fails():
    with pytest.raises(AssertionError, match=r"dp=2 x pp=2 x tp=2.*(loss at step 1|weights differ)"):
        lab7.check_train_step_3d(step_sum_not_mean)


def test_library_answers_are_refused():
    from minidist.mesh import mesh_groups
    with pytest.raises(AssertionError, match="called minidist's own implementation"):
        lab7.check_mesh_groups(mesh_groups)
    with pytest.raises(AssertionError, match="Trainer3D.reduce_gradients"):
        lab7.check_train_step_3d(step_library)


def test_predict_memory_refuses_the_cost_model_but_not_the_handed_out_helper():
    from minidist.cost.parallel3d import memory_per_rank

    def through_the_cost_model(c):
        return memory_per_rank(c.cfg, c.dp, c.pp, c.tp, c.stage, batch=c.batch, micro_batches=c.micro_batches,
                               schedule=c.schedule)
    with pytest.raises(AssertionError, match="memory_per_rank"):
        lab7.check_predict_memory(through_the_cost_model)
    lab7.check_predict_memory(memory_rounding_up)       # stage_activation_bytes is allowed, and what it calls
