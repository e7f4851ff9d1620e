"""Lab 7 (3D parallelism, the capstone): realistic wrong implementations.

Each bug edits one solution cell of solutions/lab7_3d_parallel/lab7_3d_parallel.ipynb and
names the test cells that must lose points (format: autograder/bugbank/README.md). None of
them deadlocks: a wrong group that still pairs every rank with a partner gives wrong
numbers or wrong traffic, which the checks see at once. The written answer (layout_answer)
is a markdown cell graded by hand: it has no bugs.
"""

MESH = "test_mesh_groups"
STEP = "test_train_step_3d"
MEMORY = "test_predict_memory"

BUGS = [
    # ------------------------------------------------------------------ mesh_groups
    dict(
        name="tp_groups_strided",
        cell="mesh_groups",
        replace=[("return (i_dp * pp + i_pp) * tp + i_tp", "return (i_tp * dp + i_dp) * pp + i_pp")],
        catches=[MESH],
        why="TP outermost: a TP group's ranks are dp·pp apart, spread over nodes instead of consecutive",
    ),
    dict(
        name="dp_pp_axes_swapped",
        cell="mesh_groups",
        replace=[("return (i_dp * pp + i_pp) * tp + i_tp", "return (i_pp * dp + i_dp) * tp + i_tp")],
        catches=[MESH],
        why="the grid is (pp, dp, tp): DP groups become consecutive stages, PP groups replicas",
    ),
    dict(
        name="groups_in_wrong_order",
        cell="mesh_groups",
        replace=[('"dp": [[rank(i, j, k) for i in range(dp)] for j in range(pp) for k in range(tp)]',
                  '"dp": [[rank(i, j, k) for i in range(dp)] for k in range(tp) for j in range(pp)]')],
        catches=[MESH],
        why="the DP groups are right but listed with tp varying slowest: not torch's mesh order",
    ),
    dict(
        name="no_value_error",
        cell="mesh_groups",
        replace=[(" or dp * pp * tp != world_size", "")],
        catches=[MESH],
        why="a mesh that does not multiply to the world size is accepted",
    ),
    # ------------------------------------------------------------------ train_step_3d
    dict(
        name="grads_reduced_over_tp",
        cell="train_step_3d",
        replace=[("dist.all_reduce(flat, group=dp_group)", 'dist.all_reduce(flat, group=mesh_axis(mesh, "tp")[0])')],
        catches=[STEP],
        why="gradients averaged over the TP group: different shards summed, replicas never agree",
    ),
    dict(
        name="grads_reduced_over_world",
        cell="train_step_3d",
        replace=[("dist.all_reduce(flat, group=dp_group)", "dist.all_reduce(flat)")],
        catches=[STEP],
        why="gradients all-reduced over every rank (the default group) instead of the DP group",
    ),
    dict(
        name="grads_not_divided_by_dp",
        cell="train_step_3d",
        replace=[("    flat /= dp\n", "")],
        catches=[STEP],
        why="the DP all-reduce sums the replicas' gradients: d times the global batch's gradient",
    ),
    dict(
        name="loss_scaled_by_m_twice",
        cell="train_step_3d",
        replace=[("stage.loss, act_shape=shape", "lambda out, y: stage.loss(out, y) / micro_batches, act_shape=shape")],
        catches=[STEP],
        why="the executor already scales each micro-batch's loss by 1/m: dividing again shrinks the gradient m times",
    ),
    dict(
        name="batch_sliced_by_pp_coordinate",
        cell="train_step_3d",
        replace=[('pp_group, _, pp = mesh_axis(mesh, "pp")', 'pp_group, i_pp, pp = mesh_axis(mesh, "pp")'),
                 ("local_slice(ids, i_dp, dp), local_slice(targets, i_dp, dp)",
                  "local_slice(ids, i_pp, dp), local_slice(targets, i_pp, dp)")],
        catches=[STEP],
        why="the DP slice taken by the pipeline coordinate: every replica's first stage trains on the same rows",
    ),
    dict(
        name="loss_not_averaged_over_dp",
        cell="train_step_3d",
        replace=[("return loss.item() / dp", "return loss.item()")],
        catches=[STEP],
        why="the reported loss is the sum of the d replicas' means, not the global mean",
    ),
    # ------------------------------------------------------------------ predict_memory
    dict(
        name="1f1b_counted_as_gpipe",
        cell="predict_memory",
        replace=[('c.micro_batches if c.schedule == "gpipe" else min(c.pp - c.stage, c.micro_batches)',
                  "c.micro_batches")],
        catches=[MEMORY],
        why="every schedule holds all m micro-batches: 1F1B's point (p − stage in flight) is lost",
    ),
    dict(
        name="1f1b_in_flight_p_everywhere",
        cell="predict_memory",
        replace=[("min(c.pp - c.stage, c.micro_batches)", "min(c.pp, c.micro_batches)")],
        catches=[MEMORY],
        why="1F1B holds p micro-batches on every stage; the last stage holds only one",
    ),
    dict(
        name="optimizer_states_per_replica",
        cell="predict_memory",
        replace=[('"optimizer": n * k / shard(1)', '"optimizer": n * k')],
        catches=[MEMORY],
        why="ZeRO-1 ignored: optimizer states counted whole on every DP replica instead of sharded",
    ),
    dict(
        name="forgot_embedding_and_head",
        cell="predict_memory",
        replace=[("    if stage == 0:\n        n += v // t * h + cfg.seq_len * h", "    if False:\n        pass"),
                 ("    if stage == pp - 1:\n        n += 2 * h + v // t * h", "    if False:\n        pass")],
        catches=[MEMORY],
        why="every stage counted as L/p layers: the first stage's embeddings and the last's head are missing",
    ),
    dict(
        name="layernorms_split_by_tp",
        cell="predict_memory",
        replace=[("per_layer = 2 * 2 * h + column + row", "per_layer = 2 * 2 * h // t + column + row")],
        catches=[MEMORY],
        why="LayerNorms divided by t: they are replicated on every TP rank",
    ),
    dict(
        name="micro_batch_of_the_global_batch",
        cell="predict_memory",
        replace=[("micro_batch = c.batch // (c.dp * c.micro_batches)", "micro_batch = c.batch // c.micro_batches")],
        catches=[MEMORY],
        why="a micro-batch cut from the global batch, not from this replica's B/d rows",
    ),
]
