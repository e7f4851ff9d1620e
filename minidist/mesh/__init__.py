"""3D parallelism: DP × PP × TP on torch's device mesh (Narayanan et al. 2021, PTD-P).

    from minidist.mesh import mesh_groups, rank_grid, make_mesh, Trainer3D
    mesh_groups(8, dp=2, pp=2, tp=2)["tp"]      # [[0, 1], [2, 3], [4, 5], [6, 7]], no process needed
    print(rank_grid(2, 2, 2, gpus_per_node=4))  # who holds which coordinate, node, groups
    trainer = Trainer3D(TinyGPT(cfg), 2, 2, 2, batch=8, micro_batches=2, schedule="1f1b")   # inside a rank
    loss = trainer.step(ids, targets)           # global batch in, global mean loss out, on every rank

Costs (bytes per axis, memory per rank, the layout planner): :mod:`minidist.cost.parallel3d`,
:mod:`minidist.cost.planner`.
"""
from minidist.mesh.grid import (AXES, check_layout, coordinate, groups_of, innermost_contiguous, make_mesh,
                                mesh_groups, rank_grid, rank_of)
from minidist.mesh.stage import GPTStage, stage_layers
from minidist.mesh.step import LOSS_DTYPE, Trainer3D, check_3d

__all__ = ["AXES", "check_layout", "coordinate", "groups_of", "innermost_contiguous", "make_mesh", "mesh_groups",
           "rank_grid", "rank_of", "GPTStage", "stage_layers", "LOSS_DTYPE", "Trainer3D", "check_3d"]
