"""Lab 9 (expert parallelism: router, load-balancing loss, dispatch, combine, MoE layer): realistic
wrong implementations, and correct alternatives to the solution that must get full marks.

Each bug edits one solution cell of solutions/lab9_expert_parallel/lab9_expert_parallel.ipynb
and names the test cells that must lose points; each alternative rewrites one solution cell
correctly (format: solutions/BUGBANK.md).

While one function is graded, the checks stand thin adapters over minidist.expert_parallel in for
the notebook's functions it calls (minidist.checks.lab9_expert_parallel.stand_ins), so a wrong
dispatch fails its own test only, not the combine's or the layer's. Some bugs give the right numbers on balanced loads and fail only on
the uneven ones (experts owned round-robin, received rows left in source order); some only with
capacity (a token's second choice served before another's first).
"""

ROUTER = "test_top_k_router"
LOSS = "test_load_balancing_loss"
DISPATCH = "test_ep_dispatch"
COMBINE = "test_ep_combine"
MOE = "test_moe_layer"

BUGS = [
    # ------------------------------------------------------------------ top_k_router
    dict(
        name="router_capacity_rounded_down",
        cell="top_k_router",
        replace=[("capacity = math.ceil(capacity_factor * n * k / num_experts)",
                  "capacity = int(capacity_factor * n * k / num_experts)")],
        catches=[ROUTER],
        why="C = floor(cf·n·k/E): one slot too few whenever cf·n·k/E is not whole",
    ),
    dict(
        name="router_weights_not_renormalised",
        cell="top_k_router",
        replace=[("weights = top / top.sum(dim=-1, keepdim=True)", "weights = top")],
        catches=[ROUTER],
        why="the chosen probabilities used as they are: a token's k weights do not sum to 1",
    ),
    dict(
        name="router_token_major_queue",
        cell="top_k_router",
        replace=[("queue = F.one_hot(expert_indices.t().reshape(-1), num_experts)",
                  "queue = F.one_hot(expert_indices.reshape(-1), num_experts)"),
                 ("keep = (place < capacity).view(k, n).t()", "keep = (place < capacity).view(n, k)")],
        catches=[ROUTER],
        why="the queue in token order: token 0's second choice takes a slot before token 7's first",
    ),
    dict(
        name="router_place_off_by_one",
        cell="top_k_router",
        replace=[("place = (queue.cumsum(dim=0) * queue).sum(dim=-1) - 1",
                  "place = (queue.cumsum(dim=0) * queue).sum(dim=-1)")],
        catches=[ROUTER],
        why="places counted from 1: every expert keeps one choice fewer than its capacity",
    ),
    dict(
        name="router_no_k_check",
        cell="top_k_router",
        replace=[("    if not 1 <= k <= num_experts:\n        raise ValueError(f\"k = {k}: a token chooses between 1 and "
                  "E = {num_experts} experts\")\n", "")],
        catches=[ROUTER],
        why="k > E and k = 0 not refused: torch.topk's RuntimeError (or an empty choice) instead of a ValueError",
    ),

    # ------------------------------------------------------------------ load_balancing_loss
    dict(
        name="loss_fraction_not_divided_by_k",
        cell="load_balancing_loss",
        replace=[("f = counts.to(router_probs.dtype) / (n * k)", "f = counts.to(router_probs.dtype) / n")],
        catches=[LOSS],
        why="f_i counts choices over tokens: with k = 2 the loss is twice Switch's and 2 when balanced",
    ),
    dict(
        name="loss_first_choice_only",
        cell="load_balancing_loss",
        replace=[("counts = torch.bincount(expert_indices.reshape(-1), minlength=num_experts)",
                  "counts = torch.bincount(expert_indices[:, 0], minlength=num_experts) * k")],
        catches=[LOSS],
        why="only the first choices counted (Switch's k = 1 formula applied to top-2)",
    ),
    dict(
        name="loss_missing_num_experts_factor",
        cell="load_balancing_loss",
        replace=[("return num_experts * (f * p).sum()", "return (f * p).sum()")],
        catches=[LOSS],
        why="the factor E left out: the loss is 1/E when balanced and its gradient E times too small",
    ),
    dict(
        name="loss_probs_summed",
        cell="load_balancing_loss",
        replace=[("p = router_probs.mean(dim=0)", "p = router_probs.sum(dim=0)")],
        catches=[LOSS],
        why="P_i summed over the tokens instead of averaged: the loss grows with the batch",
    ),

    # ------------------------------------------------------------------ ep_dispatch
    dict(
        name="dispatch_backward_splits_not_swapped",
        cell="ep_dispatch",
        replace=[("return exchange_rows(grad, recv_splits, send_splits, ctx.group), None, None, None",
                  "return exchange_rows(grad, send_splits, recv_splits, ctx.group), None, None, None")],
        catches=[DISPATCH],
        why="backward repeats the forward's splits: gradients go to the wrong ranks (or the sizes do not match)",
    ),
    dict(
        name="dispatch_rows_left_in_source_order",
        cell="ep_dispatch",
        replace=[("return rows[sort_by_expert(recv_counts)], Route(order, send_counts, recv_counts)",
                  "return rows, Route(order, send_counts, recv_counts)")],
        catches=[DISPATCH],
        why="received rows not regrouped: expert 0's block holds rank 0's rows for every local expert",
    ),
    dict(
        name="dispatch_round_robin_owners",
        cell="ep_dispatch",
        replace=[("send_splits = send_counts.view(e, -1).sum(dim=1).tolist()",
                  "send_splits = send_counts.view(-1, e).sum(dim=0).tolist()")],
        catches=[DISPATCH],
        why="rows sent as if expert j lived on rank j % e (round-robin), not on rank j // (E/e)",
    ),
    dict(
        name="dispatch_sends_dropped_choices",
        cell="ep_dispatch",
        replace=[("    order = order[flat[order] >= 0]                       # dropped choices (-1) go nowhere\n", "")],
        catches=[DISPATCH],
        why="dropped choices (-1) are not left out: bincount of a negative index fails",
    ),
    dict(
        name="dispatch_no_split_check",
        cell="ep_dispatch",
        replace=[("    if num_experts % e:\n        raise ValueError(f\"{num_experts} experts do not split over {e} "
                  "ranks\")\n", "")],
        catches=[DISPATCH],
        why="E not divisible by e is not refused before the counts exchange: gloo fails instead of a ValueError",
    ),
    dict(
        name="dispatch_counts_without_device",
        cell="ep_dispatch",
        replace=[("    recv_counts = torch.empty_like(send_counts)\n",
                  "    recv_counts = torch.empty(num_experts, dtype=torch.long)\n")],
        catches=["test_ep_device"],
        why="the buffer for the received counts is made without device=: right on CPU ranks, a CPU tensor for "
            "NCCL's all-to-all on a GPU node (only the device check sees it)",
    ),

    # ------------------------------------------------------------------ ep_combine
    dict(
        name="combine_splits_not_swapped",
        cell="ep_combine",
        replace=[("rows = all_to_all_rows(by_source, recv_splits, send_splits, group)",
                  "rows = all_to_all_rows(by_source, send_splits, recv_splits, group)")],
        catches=[COMBINE],
        why="the results are sent with dispatch's splits, not the reverse: rows go to the wrong ranks",
    ),
    dict(
        name="combine_expert_order_not_undone",
        cell="ep_combine",
        replace=[("by_source = expert_outputs[torch.argsort(sort_by_expert(route.recv_counts))]",
                  "by_source = expert_outputs")],
        catches=[COMBINE],
        why="the rows are sent back grouped by expert, not in the order they arrived",
    ),
    dict(
        name="combine_weights_ignored",
        cell="ep_combine",
        replace=[("return out.index_add(0, route.order // k, rows * w)",
                  "return out.index_add(0, route.order // k, rows)")],
        catches=[COMBINE],
        why="the experts' outputs are summed without the router's weights",
    ),
    dict(
        name="combine_weights_choice_major",
        cell="ep_combine",
        replace=[("w = weights.reshape(-1)[route.order].unsqueeze(-1)",
                  "w = weights.t().reshape(-1)[route.order].unsqueeze(-1)")],
        catches=[COMBINE],
        why="pair numbers read as choice·n + token: each row gets another pair's weight",
    ),
    dict(
        name="combine_indexed_add_loses_duplicates",
        cell="ep_combine",
        replace=[("return out.index_add(0, route.order // k, rows * w)",
                  "out[route.order // k] += rows * w\n    return out")],
        catches=[COMBINE],
        why="out[idx] += ... with a token twice in idx keeps one of its k contributions",
    ),

    # ------------------------------------------------------------------ moe_layer
    dict(
        name="moe_dropped_choices_sent",
        cell="moe_layer",
        replace=[("rows, route = ep_dispatch(x, expert_indices.masked_fill(~keep, -1), num_experts, group)",
                  "rows, route = ep_dispatch(x, expert_indices, num_experts, group)")],
        catches=[MOE],
        why="the kept-choice mask is ignored: with capacity, dropped choices are processed anyway",
    ),
    dict(
        name="moe_experts_split_by_source",
        cell="moe_layer",
        replace=[("per_expert = rows.split(route.recv_counts.sum(dim=0).tolist())",
                  "per_expert = rows.split(route.recv_counts.sum(dim=1).tolist())")],
        catches=[MOE],
        why="rows cut by source rank instead of by local expert: experts run on other experts' tokens",
    ),
    dict(
        name="moe_router_detached",
        cell="moe_layer",
        replace=[("logits = x @ router_weight", "logits = (x @ router_weight).detach()")],
        catches=[MOE],
        why="the logits are detached: the router and x get no gradient through the weights",
    ),
    dict(
        name="moe_aux_first_choices_only",
        cell="moe_layer",
        replace=[("aux_loss = load_balancing_loss(torch.softmax(logits, dim=-1), expert_indices, num_experts)",
                  "aux_loss = load_balancing_loss(torch.softmax(logits, dim=-1), expert_indices[:, :1], num_experts)")],
        catches=[MOE],
        why="the balancing loss counts only the first choices",
    ),
    dict(
        name="moe_no_router_shape_check",
        cell="moe_layer",
        replace=[("    if router_weight.dim() != 2 or router_weight.size(0) != x.size(-1):\n        raise ValueError("
                  "f\"router_weight {tuple(router_weight.shape)} does not match tokens of size {x.size(-1)}\")\n", "")],
        catches=[MOE],
        why="a router weight that does not match the tokens fails in the matmul (RuntimeError), not with a ValueError",
    ),
]

ALTERNATIVES = [
    # ------------------------------------------------------------------ top_k_router
    dict(
        name="router_softmax_of_top_logits_and_a_queue_per_choice",
        cell="top_k_router",
        code='''
def top_k_router(logits, k, capacity_factor=None):
    """(expert_indices (n, k), weights (n, k), keep (n, k)) for router logits (n, E)."""
    if logits.dim() != 2:
        raise ValueError("logits must be 2-D")
    n, num_experts = logits.shape
    if k < 1 or k > num_experts:
        raise ValueError(f"k must be in 1..{num_experts}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError("capacity_factor must be > 0")
    expert_indices = torch.sort(logits, dim=-1, descending=True).indices[:, :k]
    weights = torch.softmax(logits.gather(-1, expert_indices), dim=-1)     # p_i / sum p_j = softmax of the k logits
    keep = torch.ones(n, k, dtype=torch.bool, device=logits.device)
    if capacity_factor is None:
        return expert_indices, weights, keep
    capacity = -(-capacity_factor * n * k // num_experts)                  # ceil
    used = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    for c in range(k):                                                     # first choices, then second ...
        onehot = F.one_hot(expert_indices[:, c], num_experts)
        place = used[expert_indices[:, c]] + (onehot.cumsum(0) * onehot).sum(-1) - 1
        keep[:, c] = place < capacity
        used += onehot.sum(0)
    return expert_indices, weights, keep
''',
        why="softmax over the k chosen logits (equal to renormalised probabilities), one queue pass per choice",
    ),
    dict(
        name="router_python_queue",
        cell="top_k_router",
        code='''
def top_k_router(logits, k, capacity_factor=None):
    """(expert_indices (n, k), weights (n, k), keep (n, k)) for router logits (n, E)."""
    if logits.ndim != 2 or not 0 < k <= logits.shape[1] or (capacity_factor is not None and capacity_factor <= 0):
        raise ValueError(f"bad router input: logits {tuple(logits.shape)}, k={k}, capacity_factor={capacity_factor}")
    n, num_experts = logits.shape
    probs = logits.softmax(-1)
    top = probs.topk(k)
    weights = top.values / top.values.sum(-1, keepdim=True)
    if capacity_factor is None:
        keep = torch.ones_like(top.indices, dtype=torch.bool)
    else:
        slots = math.ceil(capacity_factor * n * k / num_experts)
        taken = [0] * num_experts
        keep_list = [[False] * k for _ in range(n)]
        for c in range(k):
            for t, j in enumerate(top.indices[:, c].tolist()):
                keep_list[t][c] = taken[j] < slots
                taken[j] += 1
        keep = torch.tensor(keep_list, dtype=torch.bool, device=logits.device)
    return top.indices, weights, keep
''',
        why="the queue walked in Python, choice by choice and token by token",
    ),

    # ------------------------------------------------------------------ load_balancing_loss
    dict(
        name="loss_one_hot_counts",
        cell="load_balancing_loss",
        code='''
def load_balancing_loss(router_probs, expert_indices, num_experts):
    """Switch's auxiliary loss E · Σ_i f_i · P_i (1 when the routing is perfectly balanced)."""
    if router_probs.dim() != 2 or tuple(router_probs.shape) != (expert_indices.shape[0], num_experts):
        raise ValueError("router_probs must be (tokens, num_experts)")
    f = F.one_hot(expert_indices, num_experts).to(router_probs.dtype).mean(dim=(0, 1))
    return num_experts * torch.dot(f, router_probs.mean(0))
''',
        why="fractions from a one-hot mean over tokens and choices, a dot product",
    ),
    dict(
        name="loss_index_add_counts",
        cell="load_balancing_loss",
        code='''
def load_balancing_loss(router_probs, expert_indices, num_experts):
    """Switch's auxiliary loss E · Σ_i f_i · P_i (1 when the routing is perfectly balanced)."""
    n, k = expert_indices.shape
    if tuple(router_probs.shape) != (n, num_experts):
        raise ValueError("router_probs does not match the choices")
    flat = expert_indices.flatten()
    counts = torch.zeros(num_experts, dtype=router_probs.dtype, device=router_probs.device)
    counts = counts.index_add(0, flat, torch.ones(flat.numel(), dtype=router_probs.dtype, device=flat.device))
    return (counts * router_probs.sum(0)).sum() * num_experts / (n * n * k)
''',
        why="counts by index_add, the two normalisations folded into one division",
    ),

    # ------------------------------------------------------------------ ep_dispatch
    dict(
        name="dispatch_per_expert_gather_and_explicit_regroup",
        cell="ep_dispatch",
        code='''
class AllToAllRows(torch.autograd.Function):
    """Rows to the group's ranks in uneven splits; backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.save = (list(send_splits), list(recv_splits), group)
        return exchange_rows(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits, group = ctx.save
        return AllToAllRows.apply(grad, recv_splits, send_splits, group), None, None, None


def exchange_rows(rows, send_splits, recv_splits, group):
    """One uneven all-to-all (no autograd): send_splits[s] rows to group rank s, recv_splits[s] from it."""
    out = torch.empty(sum(recv_splits), rows.shape[1], dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out


def all_to_all_rows(rows, send_splits, recv_splits, group=None):
    return AllToAllRows.apply(rows, send_splits, recv_splits, group)


def ep_dispatch(tokens, expert_indices, num_experts, group=None):
    """(expert_inputs (m, h) grouped by local expert, Route) for this rank's tokens and choices."""
    e = dist.get_world_size(group)
    if num_experts % e != 0 or expert_indices.shape[0] != tokens.shape[0] or expert_indices.ndim != 2:
        raise ValueError("experts must split over the group, and expert_indices have one row per token")
    local, k = num_experts // e, expert_indices.shape[1]
    flat = expert_indices.flatten()
    order = torch.cat([(flat == j).nonzero().flatten() for j in range(num_experts)])   # by expert, token order
    send_counts = torch.stack([(flat == j).sum() for j in range(num_experts)])
    recv_counts = torch.zeros_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.reshape(e, local)
    rows = all_to_all_rows(tokens.index_select(0, order // k), [int(c) for c in send_counts.reshape(e, local).sum(1)],
                           [int(c) for c in recv_counts.sum(1)], group)
    starts = [0]
    for c in recv_counts.flatten().tolist():
        starts.append(starts[-1] + c)
    perm = [i for j in range(local) for s in range(e)
            for i in range(starts[s * local + j], starts[s * local + j + 1])]
    perm = torch.tensor(perm, dtype=torch.long, device=tokens.device)
    return rows.index_select(0, perm), Route(order, send_counts, recv_counts)
''',
        why="order and counts expert by expert, keyword splits, a backward through apply, the regroup built by hand",
    ),
    dict(
        name="dispatch_skips_exchange_alone",
        cell="ep_dispatch",
        code='''
class AllToAllRows(torch.autograd.Function):
    """Rows to the group's ranks in uneven splits; backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return exchange_rows(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.splits[1], ctx.splits[0], ctx.group), None, None, None


def exchange_rows(rows, send_splits, recv_splits, group):
    """One uneven all-to-all (no autograd): send_splits[s] rows to group rank s, recv_splits[s] from it."""
    if dist.get_world_size(group) == 1:
        return rows.clone()
    out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all_rows(rows, send_splits, recv_splits, group=None):
    return AllToAllRows.apply(rows, send_splits, recv_splits, group)


def ep_dispatch(tokens, expert_indices, num_experts, group=None):
    """(expert_inputs (m, h) grouped by local expert, Route) for this rank's tokens and choices."""
    _, e = group_rank_size(group)
    if num_experts % e:
        raise ValueError(f"E = {num_experts} is not a multiple of the group size {e}")
    if expert_indices.dim() != 2 or len(expert_indices) != len(tokens):
        raise ValueError("expert_indices must be (tokens, k)")
    k = expert_indices.size(1)
    keys = expert_indices.flatten()
    keys = torch.where(keys < 0, num_experts, keys)                 # dropped pairs sort last ...
    order = torch.sort(keys, stable=True).indices
    order = order[: int((keys < num_experts).sum())]                # ... and are cut off
    send_counts = F.one_hot(keys[order], num_experts).sum(0) if len(order) else \\
        torch.zeros(num_experts, dtype=torch.long, device=tokens.device)
    if e == 1:
        recv_counts = send_counts.clone()
    else:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(e, -1)
    rows = all_to_all_rows(tokens[order // k], send_counts.view(e, -1).sum(1).tolist(), recv_counts.sum(1).tolist(),
                           group)
    return rows[sort_by_expert(recv_counts)], Route(order, send_counts, recv_counts)
''',
        why="dropped pairs sorted last and cut, counts by one-hot, nothing exchanged in a group of one",
    ),

    # ------------------------------------------------------------------ ep_combine
    dict(
        name="combine_scatter_add",
        cell="ep_combine",
        code='''
def ep_combine(expert_outputs, weights, route, group=None):
    """Each token's weighted sum of its experts' outputs, (n, h), on the token's own rank."""
    e = dist.get_world_size(group)
    n, k = weights.shape
    perm = sort_by_expert(route.recv_counts)
    by_source = torch.empty_like(expert_outputs).index_copy(0, perm, expert_outputs)    # rows[perm] = outputs
    rows = all_to_all_rows(by_source, route.recv_counts.sum(1).tolist(),
                           route.send_counts.reshape(e, -1).sum(1).tolist(), group)
    scaled = rows * weights.flatten().gather(0, route.order)[:, None]
    index = (route.order // k)[:, None].expand_as(scaled)
    return torch.zeros(n, rows.shape[1], dtype=rows.dtype, device=rows.device).scatter_add(0, index, scaled)
''',
        why="the expert order undone with index_copy, the tokens summed with scatter_add",
    ),
    dict(
        name="combine_dense_pairs_then_weighted_sum",
        cell="ep_combine",
        code='''
def ep_combine(expert_outputs, weights, route, group=None):
    """Each token's weighted sum of its experts' outputs, (n, h), on the token's own rank."""
    _, e = group_rank_size(group)
    n, k = weights.shape
    h = expert_outputs.shape[1]
    back = expert_outputs[sort_by_expert(route.recv_counts).argsort()]
    rows = all_to_all_rows(back, route.recv_counts.sum(1).tolist(), route.send_counts.view(e, -1).sum(1).tolist(),
                           group)
    pairs = rows.new_zeros(n * k, h).index_copy(0, route.order, rows)      # dropped pairs stay 0
    return (pairs.view(n, k, h) * weights.unsqueeze(-1).to(rows.dtype)).sum(dim=1)
''',
        why="every pair's row in an (n·k, h) buffer (zeros for dropped ones), then a weighted sum over the k choices",
    ),

    # ------------------------------------------------------------------ moe_layer
    dict(
        name="moe_experts_by_offsets",
        cell="moe_layer",
        code='''
def moe_layer(x, router_weight, experts, k, group=None, capacity_factor=None):
    """(y (n, h), load-balancing loss) of a MoE layer whose E experts are spread over `group`."""
    e = dist.get_world_size(group)
    h, num_experts = router_weight.shape if router_weight.dim() == 2 else (None, None)
    if h != x.shape[-1] or num_experts % e or len(experts) * e != num_experts:
        raise ValueError(f"router_weight {tuple(router_weight.shape)}, {len(experts)} local experts and a group "
                         f"of {e} do not make a MoE layer for tokens of size {x.shape[-1]}")
    logits = x @ router_weight
    probs = torch.softmax(logits, dim=-1)
    expert_indices, weights, keep = top_k_router(logits, k, capacity_factor)
    rows, route = ep_dispatch(x, torch.where(keep, expert_indices, torch.full_like(expert_indices, -1)),
                              num_experts, group)
    outputs, start = [], 0
    for expert, count in zip(experts, route.recv_counts.sum(dim=0).tolist()):
        outputs.append(expert(rows[start:start + count]))
        start += count
    y = ep_combine(torch.cat(outputs, dim=0), weights, route, group)
    return y, load_balancing_loss(probs, expert_indices, num_experts)
''',
        why="one validation, torch.where for the dropped choices, experts run on slices by running offsets",
    ),
    dict(
        name="moe_output_buffer",
        cell="moe_layer",
        code='''
def moe_layer(x, router_weight, experts, k, group=None, capacity_factor=None):
    """(y (n, h), load-balancing loss) of a MoE layer whose E experts are spread over `group`."""
    rank, e = group_rank_size(group)
    if router_weight.ndim != 2 or router_weight.shape[0] != x.shape[1]:
        raise ValueError("router_weight must be (h, E) for tokens (n, h)")
    num_experts = router_weight.shape[1]
    if num_experts % e != 0 or len(experts) != num_experts // e:
        raise ValueError(f"{num_experts} experts cannot be spread as {len(experts)} per rank over {e} ranks")
    if not 1 <= k <= num_experts or (capacity_factor is not None and capacity_factor <= 0):
        raise ValueError("k must be in 1..E and capacity_factor > 0")
    logits = torch.matmul(x, router_weight)
    idx, w, keep = top_k_router(logits, k, capacity_factor)
    aux = load_balancing_loss(F.softmax(logits, dim=1), idx, num_experts)
    rows, route = ep_dispatch(x, idx.masked_fill(keep.logical_not(), -1), num_experts, group)
    counts = route.recv_counts.sum(0)
    which = torch.repeat_interleave(torch.arange(len(experts), device=rows.device), counts)
    out = rows.new_zeros(rows.shape)
    for j, expert in enumerate(experts):
        mine = (which == j).nonzero().flatten()
        out = out.index_copy(0, mine, expert(rows[mine]))
    return ep_combine(out, w, route, group), aux
''',
        why="every check up front, each expert's rows found by a label per row, outputs written into one buffer",
    ),
]
