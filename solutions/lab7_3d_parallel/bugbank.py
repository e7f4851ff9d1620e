"""Lab 7 (3D parallelism, the capstone): realistic wrong implementations.

Each bug edits one solution cell of solutions/lab7_3d_parallel/lab7_3d_parallel.ipynb and
names the test cells that must lose points (format: solutions/BUGBANK.md). None of
them deadlocks: a wrong group that still pairs every rank with a partner gives wrong
numbers or wrong traffic, which the checks see at once. The written answer (layout_answer)
is a markdown cell graded by hand: it has no bugs.
"""

MESH = "test_mesh_groups"
STEP = "test_train_step_3d"
MEMORY = "test_predict_memory"
STAGE = "test_stage_parameters"

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
    dict(
        name="mesh_sizes_not_checked_positive_integers",
        cell="mesh_groups",
        replace=[("if any(not isinstance(v, int) or v < 1 for v in sizes) or dp * pp * tp != world_size:",
                  "if dp * pp * tp != world_size:")],
        catches=[MESH],
        why="only the product is checked: (8, -2, -2, 2) returns empty groups, (6, 1, 1.5, 4) a TypeError from range",
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
    dict(
        name="step_always_1f1b",
        cell="train_step_3d",
        replace=[("run_schedule(make(schedule, pp, micro_batches)", 'run_schedule(make("1f1b", pp, micro_batches)')],
        catches=[STEP],
        why="builds 1F1B whatever schedule it is given: same losses, weights and messages, another order and peak",
    ),
    dict(
        name="loss_report_without_device",
        cell="train_step_3d",
        replace=[(", dtype=torch.float64, device=flat.device)", ", dtype=torch.float64)")],
        catches=["test_train_step_3d_device"],
        why="the loss to all-reduce is made without device=: right on CPU ranks, a CPU tensor for NCCL's "
            "all-reduce on a GPU node (only the device check sees it)",
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
        cell="stage_parameters",
        replace=[("    if stage == 0:\n        n += v // t * h + cfg.seq_len * h", "    if False:\n        pass"),
                 ("    if stage == pp - 1:\n        n += 2 * h + v // t * h", "    if False:\n        pass")],
        catches=[STAGE, MEMORY],
        why="every stage counted as L/p layers: the first stage's embeddings and the last's head are missing",
    ),
    dict(
        name="layernorms_split_by_tp",
        cell="stage_parameters",
        replace=[("per_layer = 2 * 2 * h + column + row", "per_layer = 2 * 2 * h // t + column + row")],
        catches=[STAGE, MEMORY],
        why="LayerNorms divided by t: they are replicated on every TP rank",
    ),
    dict(
        name="row_parallel_bias_split_by_tp",
        cell="stage_parameters",
        replace=[("row = (h * h + f * h) // t + 2 * b * h", "row = (h * h + f * h + 2 * b * h) // t")],
        catches=[STAGE],
        why="the row-parallel layers' biases divided by t: they are added once, after the all-reduce, and whole",
    ),
    dict(
        name="gqa_kv_counted_as_full_heads",
        cell="stage_parameters",
        replace=[("kv, b = cfg.n_kv_heads * cfg.head_dim, int(cfg.bias)", "kv, b = h, int(cfg.bias)")],
        catches=[STAGE],
        why="k and v counted with every query head: grouped-query attention's smaller projections ignored",
    ),
    dict(
        name="micro_batch_of_the_global_batch",
        cell="predict_memory",
        replace=[("micro_batch = c.batch // (c.dp * c.micro_batches)", "micro_batch = c.batch // c.micro_batches")],
        catches=[MEMORY],
        why="a micro-batch cut from the global batch, not from this replica's B/d rows",
    ),
]

# correct implementations other than the solution's: each must get full marks
ALTERNATIVES = [
    # ------------------------------------------------------------------ mesh_groups
    dict(
        name="mesh_by_reshaping_arange",
        cell="mesh_groups",
        code='''
def mesh_groups(world_size, dp, pp, tp):
    """Rank lists of every DP, PP and TP group of a row-major (dp, pp, tp) mesh, TP innermost."""
    if any(not isinstance(v, int) or v < 1 for v in (world_size, dp, pp, tp)) or dp * pp * tp != world_size:
        raise ValueError("the mesh does not hold the world")
    grid = torch.arange(world_size).view(dp, pp, tp)
    # move the axis last, flatten the others in row-major order: one row per group
    return {"dp": grid.permute(1, 2, 0).reshape(-1, dp).tolist(),
            "pp": grid.permute(0, 2, 1).reshape(-1, pp).tolist(),
            "tp": grid.reshape(-1, tp).tolist()}
''',
        why="torch.arange(world).view(dp, pp, tp), the axis permuted last and the rest flattened: one row per group",
    ),
    dict(
        name="mesh_by_bucketing_coordinates",
        cell="mesh_groups",
        code='''
def mesh_groups(world_size, dp, pp, tp):
    """Rank lists of every DP, PP and TP group of a row-major (dp, pp, tp) mesh, TP innermost."""
    for v in (world_size, dp, pp, tp):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"mesh sizes must be positive integers, got {v!r}")
    if dp * pp * tp != world_size:
        raise ValueError(f"{dp} x {pp} x {tp} != {world_size}")
    groups = {"dp": {}, "pp": {}, "tp": {}}
    for r in range(world_size):                      # increasing rank = row-major order of the coordinates
        i_dp, i_pp, i_tp = r // (pp * tp), (r // tp) % pp, r % tp
        groups["dp"].setdefault((i_pp, i_tp), []).append(r)
        groups["pp"].setdefault((i_dp, i_tp), []).append(r)
        groups["tp"].setdefault((i_dp, i_pp), []).append(r)
    return {axis: list(by_key.values()) for axis, by_key in groups.items()}
''',
        why="decodes every rank's coordinates and buckets it by the other two (dicts keep first-seen order)",
    ),
    dict(
        name="mesh_by_strided_ranges",
        cell="mesh_groups",
        code='''
def mesh_groups(world_size, dp, pp, tp):
    """Rank lists of every DP, PP and TP group of a row-major (dp, pp, tp) mesh, TP innermost."""
    if not all(isinstance(v, int) and v > 0 for v in (world_size, dp, pp, tp)) or dp * pp * tp != world_size:
        raise ValueError(f"(dp={dp}, pp={pp}, tp={tp}) does not multiply to world_size={world_size}")
    return {
        "dp": [list(range(j * tp + k, world_size, pp * tp)) for j in range(pp) for k in range(tp)],
        "pp": [list(range(i * pp * tp + k, (i + 1) * pp * tp, tp)) for i in range(dp) for k in range(tp)],
        "tp": [list(range(s, s + tp)) for s in range(0, world_size, tp)],
    }
''',
        why="closed form with strides: DP ranks pp·tp apart, PP ranks tp apart, TP ranks consecutive",
    ),

    # ------------------------------------------------------------------ train_step_3d
    dict(
        name="step_per_parameter_all_reduce_loss_broadcast",
        cell="train_step_3d",
        code='''
def train_step_3d(stage, optimizer, ids, targets, mesh, micro_batches, schedule="1f1b"):
    """One DP x PP x TP training step of this rank's stage; returns the global mean loss."""
    dp_group, i_dp, dp = mesh_axis(mesh, "dp")
    pp_group, _, pp = mesh_axis(mesh, "pp")
    ids, targets = local_slice(ids, i_dp, dp), local_slice(targets, i_dp, dp)
    optimizer.zero_grad()
    stats = run_schedule(make(schedule, pp, micro_batches), [stage], ids if stage.first else None,
                         targets if stage.last else None, stage.loss,
                         act_shape=stage.activation_shape(ids.shape[0] // micro_batches, ids.shape[1]),
                         group=pp_group)
    for p in stage.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dp
    optimizer.step()
    loss = torch.tensor(stats.loss if stage.last else 0.0, device=ids.device)
    dist.broadcast(loss, src=dist.get_global_rank(pp_group, pp - 1), group=pp_group)
    dist.all_reduce(loss, group=dp_group)
    return loss.item() / dp
''',
        why="one all-reduce per parameter over DP; the loss broadcast from the last stage over PP, then "
            "averaged over DP",
    ),
    dict(
        name="step_sequence_parallel_ready_divide_first",
        cell="train_step_3d",
        replace=[("    grads = [p.grad for p in stage.parameters() if p.grad is not None]\n",
                  "    stage.sync_grads()          # sequence parallelism: LayerNorm grads summed over TP (else a no-op)\n"
                  "    grads = [p.grad for p in stage.parameters() if p.grad is not None]\n"),
                 ("    flat = torch.cat([g.flatten() for g in grads])          # one all-reduce, not one per tensor\n"
                  "    dist.all_reduce(flat, group=dp_group)\n    flat /= dp\n",
                  "    flat = torch.cat([g.flatten() for g in grads]) / dp     # average first, then sum\n"
                  "    dist.all_reduce(flat, group=dp_group)\n")],
        why="the going-further sequence-parallel step: stage.sync_grads() before the DP all-reduce (a no-op "
            "on a stage without sequence parallelism), and the flat gradient divided by d before the sum",
    ),
    dict(
        name="step_async_per_parameter_all_reduces",
        cell="train_step_3d",
        code='''
def train_step_3d(stage, optimizer, ids, targets, mesh, micro_batches, schedule="1f1b"):
    """One DP x PP x TP training step of this rank's stage; returns the global mean loss."""
    dp_group, i_dp, dp = mesh_axis(mesh, "dp")
    pp_group, i_pp, pp = mesh_axis(mesh, "pp")
    x = local_slice(ids, i_dp, dp) if stage.first else None
    y = local_slice(targets, i_dp, dp) if stage.last else None
    local_batch = ids.shape[0] // dp
    for p in stage.parameters():
        p.grad = None
    stats = run_schedule(make(schedule, pp, micro_batches), [stage], x, y, stage.loss,
                         act_shape=stage.activation_shape(local_batch // micro_batches, ids.shape[1]),
                         group=pp_group)
    pending = [(p.grad, dist.all_reduce(p.grad, group=dp_group, async_op=True))
               for p in stage.parameters() if p.grad is not None]
    for grad, work in pending:
        work.wait()
        grad.div_(dp)
    optimizer.step()
    loss = torch.zeros(1, device=ids.device)
    if i_pp == pp - 1:
        loss += stats.loss / dp             # this replica's share of the global mean
    dist.all_reduce(loss, group=pp_group)
    dist.all_reduce(loss, group=dp_group)
    return float(loss)
''',
        why="slices only the ends that need the batch, async all-reduce per parameter then wait all, the loss "
            "divided by d before its two sums (in float32)",
    ),
    dict(
        name="step_zero1_over_dp",
        cell="train_step_3d",
        code='''
def train_step_3d(stage, optimizer, ids, targets, mesh, micro_batches, schedule="1f1b"):
    """One training step of this rank's stage; returns the global batch's mean loss."""
    dp_group, i_dp, dp = mesh_axis(mesh, "dp")
    pp_group, _, pp = mesh_axis(mesh, "pp")
    ids, targets = local_slice(ids, i_dp, dp), local_slice(targets, i_dp, dp)
    params = [p for p in stage.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    size = -(-numel // dp)
    if not hasattr(stage, "zero1"):          # this rank's shard of the flat parameters, and its optimizer
        flat = torch.zeros(size * dp, device=params[0].device)
        flat[:numel] = torch.cat([p.detach().flatten() for p in params])
        shard = flat[i_dp * size:(i_dp + 1) * size].clone().requires_grad_()
        stage.zero1 = (shard, type(optimizer)([shard], **optimizer.defaults))
    shard, shard_optimizer = stage.zero1
    for p in params:
        p.grad = None
    stats = run_schedule(make(schedule, pp, micro_batches), [stage], ids if stage.first else None,
                         targets if stage.last else None, stage.loss,
                         act_shape=stage.activation_shape(ids.shape[0] // micro_batches, ids.shape[1]),
                         group=pp_group)
    flat_grad = torch.zeros(size * dp, device=params[0].device)
    flat_grad[:numel] = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])
    mine = torch.empty(size, device=params[0].device)
    dist.reduce_scatter_tensor(mine, flat_grad, group=dp_group)
    shard.grad = mine / dp
    shard_optimizer.step()
    full = torch.empty(size * dp, device=params[0].device)
    dist.all_gather_into_tensor(full, shard.detach(), group=dp_group)
    with torch.no_grad():
        for p, new in zip(params, full[:numel].split([p.numel() for p in params])):
            p.copy_(new.view_as(p))
            p.grad = None
    loss = torch.tensor([stats.loss if stats.loss is not None else 0.0], dtype=torch.float64, device=shard.device)
    dist.all_reduce(loss, group=pp_group)
    dist.all_reduce(loss, group=dp_group)
    return loss.item() / dp
''',
        why="the going-further ZeRO-1 over DP: reduce-scatter the flat gradient, step a sharded optimizer, "
            "all-gather the parameters",
    ),

    # ------------------------------------------------------------------ predict_memory
    dict(
        name="memory_one_function_zero_rounds_up",
        cell="predict_memory",
        code='''
import math


def predict_memory(c):
    """Bytes on one rank: params, grads, optimizer, activations, total."""
    h, f, v, t, b = c.cfg.d_model, c.cfg.d_ff, c.cfg.vocab, c.tp, int(c.cfg.bias)
    kv = c.cfg.n_kv_heads * c.cfg.head_dim
    layer = 4 * h + (h + b) * (h + 2 * kv + f) // t + (h * h + f * h) // t + 2 * b * h
    n = c.cfg.n_layers // c.pp * layer + (v // t * h + c.cfg.seq_len * h if c.stage == 0 else 0) \\
        + (2 * h + v // t * h if c.stage == c.pp - 1 else 0)
    e, k = c.elem_bytes, {"adam": 2, "sgd": 1}[c.optimizer] * c.elem_bytes
    sharded = lambda numel, z: math.ceil(numel / c.dp) if c.zero_stage >= z else numel   # noqa: E731
    out = {"params": sharded(n, 3) * e, "grads": sharded(n, 2) * e, "optimizer": sharded(n, 1) * k}
    flight = c.micro_batches if c.schedule == "gpipe" else min(c.pp - c.stage, c.micro_batches)
    out["activations"] = flight * stage_activation_bytes(c.cfg, c.batch // (c.dp * c.micro_batches), c.pp, c.tp,
                                                         c.stage, elem_bytes=e)
    out["total"] = sum(out.values())
    return out
''',
        why="one function, no stage_parameters helper; a ZeRO shard is a whole number of elements (rounded up)",
    ),
    dict(
        name="memory_per_tensor_shape_table",
        cell="stage_parameters",
        replace=[("    h, f, v, t = cfg.d_model, cfg.d_ff, cfg.vocab, tp\n"
                  "    kv, b = cfg.n_kv_heads * cfg.head_dim, int(cfg.bias)\n"
                  "    column = (h + b) * (h + 2 * kv + f) // t          # q, k, v, fc: weight rows and bias split\n"
                  "    row = (h * h + f * h) // t + 2 * b * h            # o, proj: weights split, bias whole\n"
                  "    per_layer = 2 * 2 * h + column + row              # + two LayerNorms, replicated\n"
                  "    n = cfg.n_layers // pp * per_layer\n"
                  "    if stage == 0:\n"
                  "        n += v // t * h + cfg.seq_len * h             # vocab-parallel token embedding, positions\n"
                  "    if stage == pp - 1:\n"
                  "        n += 2 * h + v // t * h                       # final LayerNorm, vocab-parallel LM head\n"
                  "    return n\n",
                  "    h, f, v, t = cfg.d_model, cfg.d_ff, cfg.vocab, tp\n"
                  "    kv, bias = cfg.n_kv_heads * cfg.head_dim, cfg.bias\n"
                  "    # (elements, divided by t?) of every tensor of one layer\n"
                  "    layer = [(h, False), (h, False), (h, False), (h, False)]           # ln1, ln2: weight, bias\n"
                  "    for out_features in (h, kv, kv, f):                                 # q, k, v, fc: column-parallel\n"
                  "        layer.append((out_features * h, True))\n"
                  "        if bias:\n"
                  "            layer.append((out_features, True))\n"
                  "    for in_features in (h, f):                                          # o, proj: row-parallel\n"
                  "        layer.append((h * in_features, True))\n"
                  "        if bias:\n"
                  "            layer.append((h, False))\n"
                  "    tensors = layer * (cfg.n_layers // pp)\n"
                  "    if stage == 0:\n"
                  "        tensors += [(v * h, True), (cfg.seq_len * h, False)]           # token, position embeddings\n"
                  "    if stage == pp - 1:\n"
                  "        tensors += [(h, False), (h, False), (v * h, True)]             # final LayerNorm, LM head\n"
                  "    return sum(numel // t if split else numel for numel, split in tensors)\n")],
        why="counts the stage's parameters tensor by tensor from a table of (elements, split by t?) instead "
            "of the closed form",
    ),
    dict(
        name="stage_parameters_split_and_whole",
        cell="stage_parameters",
        code='''
def stage_parameters(cfg, pp, tp, stage):
    \"\"\"Parameters one TP rank of pipeline stage `stage` holds.\"\"\"
    h, f, t = cfg.d_model, cfg.d_ff, tp
    kv, bias = cfg.n_kv_heads * cfg.head_dim, 1 if cfg.bias else 0
    # one layer: what the t ranks share out, and what each keeps whole
    split = h * (h + 2 * kv) + h * h + 2 * h * f + bias * (h + 2 * kv + f)     # q k v o fc proj, column biases
    whole = 2 * 2 * h + 2 * bias * h                                          # two LayerNorms, row biases
    layers = cfg.n_layers // pp
    n = layers * split // t + layers * whole
    vocab_rows = cfg.vocab // t * h                                           # a vocab-parallel table
    if stage == 0:
        n += vocab_rows + cfg.seq_len * h
    if stage == pp - 1:
        n += vocab_rows + 2 * h
    return n
''',
        why="sums what the TP ranks share out and what each keeps whole, per layer, then divides once",
    ),
    dict(
        name="memory_in_flight_from_the_schedule",
        cell="predict_memory",
        replace=[('    in_flight = c.micro_batches if c.schedule == "gpipe" else min(c.pp - c.stage, c.micro_batches)\n',
                  "    in_flight = peak = 0                  # replay this stage's program of lab 4's schedule\n"
                  "    for action in make(c.schedule, c.pp, c.micro_batches).compute(c.stage):\n"
                  "        in_flight += {\"F\": 1, \"B\": -1}.get(action.kind, 0)\n"
                  "        peak = max(peak, in_flight)\n"
                  "    in_flight = peak\n")],
        why="reads the micro-batches in flight off the handed-out schedule (make(...).compute(stage)) "
            "instead of the closed forms m and min(p - stage, m)",
    ),
]
