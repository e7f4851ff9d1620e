"""Lab 5 (tensor and sequence parallelism): realistic wrong implementations.

Each bug edits one solution cell of solutions/lab5_tensor_parallel/lab5_tensor_parallel.ipynb
and names the test cells that must lose points (format: autograder/bugbank/README.md).

While one function is graded, the checks stand minidist's own in for the lab's other
functions (minidist.checks.lab5_tensor_parallel), so a bug in f fails f's test only, not
those of the layers built on it. Some bugs give the right numbers and the wrong traffic
(an all-reduce where a reduce-scatter belongs, an extra collective): the traced
collectives catch those.
"""

F_TEST = "test_copy_to_tp"
G_TEST = "test_reduce_from_tp"
COLUMN = "test_column_parallel_linear"
ROW = "test_row_parallel_linear"
MLP = "test_tp_mlp"
ATTN = "test_tp_attention"
CE = "test_vocab_parallel_cross_entropy"
SP_GATHER = "test_sp_gather"
SP_RS = "test_sp_reduce_scatter"
SP_BLOCK = "test_sp_mlp_block"

BUGS = [
    # ------------------------------------------------------------------ copy_to_tp (f)
    dict(
        name="f_backward_is_identity",
        cell="copy_to_tp",
        replace=[("        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n", "")],
        catches=[F_TEST],
        why="f without its backward all-reduce: each rank keeps its own partial dL/dx",
    ),
    dict(
        name="f_all_reduces_forward",
        cell="copy_to_tp",
        replace=[("return x.view_as(x)", "out = x.clone()\n        dist.all_reduce(out, group=group)\n        return out")],
        catches=[F_TEST],
        why="f all-reduces the replicated input in forward too: the output is t times x",
    ),
    dict(
        name="f_backward_averages",
        cell="copy_to_tp",
        replace=[("        return grad, None\n", "        return grad / dist.get_world_size(ctx.group), None\n")],
        catches=[F_TEST],
        why="f's backward averages the partial gradients instead of summing them",
    ),
    dict(
        name="f_all_reduce_without_group",
        cell="copy_to_tp",
        replace=[("dist.all_reduce(grad, group=ctx.group)", "dist.all_reduce(grad)")],
        catches=[F_TEST],
        why="the backward all-reduce forgets group=: it sums over every rank, not the tensor-parallel group",
    ),

    # ------------------------------------------------------------------ reduce_from_tp (g)
    dict(
        name="g_backward_sums_again",
        cell="reduce_from_tp",
        replace=[("        return grad, None\n",
                  "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n        return grad, None\n"),
                 ("        out = x.clone()\n", "        ctx.group = group\n        out = x.clone()\n")],
        catches=[G_TEST],
        why="g with a summing backward (torch.distributed.nn.functional.all_reduce): gradients t times too large",
    ),
    dict(
        name="g_averages",
        cell="reduce_from_tp",
        replace=[("        return out\n", "        return out / dist.get_world_size(group)\n")],
        catches=[G_TEST],
        why="g averages the partial sums: the layer's output is 1/t of the right one",
    ),
    dict(
        name="g_all_reduce_without_group",
        cell="reduce_from_tp",
        replace=[("dist.all_reduce(out, group=group)", "dist.all_reduce(out)")],
        catches=[G_TEST],
        why="the forward all-reduce forgets group=: partial sums of other groups are added in",
    ),
    dict(
        name="g_backward_all_reduce_mean",
        cell="reduce_from_tp",
        replace=[("        return grad, None\n",
                  "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
                  "        return grad / dist.get_world_size(ctx.group), None\n"),
                 ("        out = x.clone()\n", "        ctx.group = group\n        out = x.clone()\n")],
        catches=[G_TEST],
        why="g's backward averages the (already equal) gradients: right numbers, one all-reduce too many",
    ),

    # ------------------------------------------------------------------ column_parallel_linear
    dict(
        name="column_without_f",
        cell="column_parallel_linear",
        replace=[("F.linear(copy_to_tp(x, group), weight, bias)", "F.linear(x, weight, bias)")],
        catches=[COLUMN],
        why="no f before the sharded matmul: dL/dx stays this rank's partial sum",
    ),
    dict(
        name="column_g_instead_of_f",
        cell="column_parallel_linear",
        replace=[("F.linear(copy_to_tp(x, group), weight, bias)", "F.linear(reduce_from_tp(x, group), weight, bias)")],
        catches=[COLUMN],
        why="g where f belongs: the replicated input is summed over ranks (t times x) and dL/dx is partial",
    ),
    dict(
        name="column_reduces_output",
        cell="column_parallel_linear",
        replace=[("return F.linear(copy_to_tp(x, group), weight, bias)",
                  "return reduce_from_tp(F.linear(copy_to_tp(x, group), weight, bias), group)")],
        catches=[COLUMN],
        why="all-reduces the column-parallel output: different ranks' output features are added together",
    ),

    # ------------------------------------------------------------------ row_parallel_linear
    dict(
        name="row_bias_before_reduce",
        cell="row_parallel_linear",
        replace=[("y = reduce_from_tp(F.linear(x, weight), group)\n    return y if bias is None else y + bias",
                  "return reduce_from_tp(F.linear(x, weight, bias), group)")],
        catches=[ROW],
        why="bias added on every rank before the all-reduce: it is counted t times",
    ),
    dict(
        name="row_without_g",
        cell="row_parallel_linear",
        replace=[("y = reduce_from_tp(F.linear(x, weight), group)", "y = F.linear(x, weight)")],
        catches=[ROW],
        why="no g: each rank returns its partial sum X_r W_rᵀ + b",
    ),
    dict(
        name="row_bias_split_over_ranks",
        cell="row_parallel_linear",
        replace=[("y = reduce_from_tp(F.linear(x, weight), group)\n    return y if bias is None else y + bias",
                  "b = None if bias is None else bias / dist.get_world_size(group)\n"
                  "    return reduce_from_tp(F.linear(x, weight, b), group)")],
        catches=[ROW],
        why="bias divided by t and added before the all-reduce: right output, but bias.grad is 1/t of the truth",
    ),
    dict(
        name="row_f_instead_of_g",
        cell="row_parallel_linear",
        replace=[("y = reduce_from_tp(F.linear(x, weight), group)", "y = F.linear(copy_to_tp(x, group), weight)")],
        catches=[ROW],
        why="f where g belongs: the partial sums are never added",
    ),

    # ------------------------------------------------------------------ tp_mlp
    dict(
        name="mlp_gelu_after_reduce",
        cell="tp_mlp",
        replace=[("return row_parallel_linear(F.gelu(h), my_chunk(mlp.proj.weight, 1, group), mlp.proj.bias, group)",
                  "return F.gelu(row_parallel_linear(h, my_chunk(mlp.proj.weight, 1, group), mlp.proj.bias, group))")],
        catches=[MLP],
        why="GeLU applied after the row-parallel layer instead of between the two",
    ),
    dict(
        name="mlp_without_f",
        cell="tp_mlp",
        replace=[("h = column_parallel_linear(x, my_chunk(mlp.fc.weight, 0, group), my_chunk(mlp.fc.bias, 0, group), group)",
                  "h = F.linear(x, my_chunk(mlp.fc.weight, 0, group), my_chunk(mlp.fc.bias, 0, group))")],
        catches=[MLP],
        why="the first matmul without f: x.grad is this rank's partial sum",
    ),
    dict(
        name="mlp_tanh_gelu",
        cell="tp_mlp",
        replace=[("F.gelu(h)", "F.gelu(h, approximate='tanh')")],
        catches=[MLP],
        why="tanh-approximate GeLU: the model uses the exact one (nn.GELU())",
    ),
    dict(
        name="mlp_proj_bias_twice",
        cell="tp_mlp",
        replace=[("my_chunk(mlp.proj.weight, 1, group), mlp.proj.bias, group)",
                  "my_chunk(mlp.proj.weight, 1, group), mlp.proj.bias, group) + mlp.proj.bias")],
        catches=[MLP],
        why="the output bias added again after the row-parallel layer already added it",
    ),

    # ------------------------------------------------------------------ tp_attention
    dict(
        name="attn_qkv_split_across_heads",
        cell="tp_attention",
        replace=[("weight = torch.cat([my_chunk(lin.weight, 0, group) for lin in (attn.q, attn.k, attn.v)])",
                  "weight = my_chunk(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]), 0, group)"),
                 ("bias = torch.cat([my_chunk(lin.bias, 0, group) for lin in (attn.q, attn.k, attn.v)])",
                  "bias = my_chunk(torch.cat([attn.q.bias, attn.k.bias, attn.v.bias]), 0, group)")],
        catches=[ATTN],
        why="the fused QKV matrix cut into t slices: rank 0 gets Q of every head, the cut runs through heads",
    ),
    dict(
        name="attn_three_fs",
        cell="tp_attention",
        replace=[("    q, k, v = column_parallel_linear(x, weight, bias, group).split(\n"
                  "        [n_heads // t * hd, n_kv // t * hd, n_kv // t * hd], dim=-1)\n",
                  "    q, k, v = (column_parallel_linear(x, my_chunk(lin.weight, 0, group), my_chunk(lin.bias, 0, group), group)\n"
                  "               for lin in (attn.q, attn.k, attn.v))\n")],
        catches=[ATTN],
        why="Q, K and V as three column-parallel layers: right numbers, three all-reduces in backward instead of one",
    ),
    dict(
        name="attn_no_head_check",
        cell="tp_attention",
        replace=[("    if n_heads % t or n_kv % t:\n"
                  "        raise ValueError(f\"{n_heads} query and {n_kv} key/value heads cannot be split by whole heads over t = {t}\")\n",
                  "")],
        catches=[ATTN],
        why="no ValueError when t does not divide the heads (hidden: 4 heads on t = 3)",
    ),
    dict(
        name="attn_o_bias_on_every_rank",
        cell="tp_attention",
        replace=[("return row_parallel_linear(y, my_chunk(attn.o.weight, 1, group), attn.o.bias, group)",
                  "return reduce_from_tp(F.linear(y, my_chunk(attn.o.weight, 1, group), attn.o.bias), group)")],
        catches=[ATTN],
        why="the output projection's bias added by every rank before the all-reduce (t times)",
    ),

    # ------------------------------------------------------------------ vocab_parallel_cross_entropy
    dict(
        name="ce_local_max",
        cell="vocab_parallel_cross_entropy",
        replace=[("    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)\n", "")],
        catches=[CE],
        why="each rank shifts by its local max: the sum of exp adds terms on different scales",
    ),
    dict(
        name="ce_foreign_target_not_masked",
        cell="vocab_parallel_cross_entropy",
        replace=[("mine = valid & (target >= start) & (target < stop)", "mine = valid"),
                 ("idx = (target - start).masked_fill(~mine, 0)", "idx = (target - start).clamp(0, local - 1)")],
        catches=[CE],
        why="a target owned by another rank is not masked: every rank adds a (clamped) target logit",
    ),
    dict(
        name="ce_boundary_off_by_one",
        cell="vocab_parallel_cross_entropy",
        replace=[("(target < stop)", "(target <= stop)")],
        catches=[CE],
        why="the first id of the next rank's slice is counted by this rank too (out of its range)",
    ),
    dict(
        name="ce_mean_over_ignored",
        cell="vocab_parallel_cross_entropy",
        replace=[("return losses.sum() / valid.sum()", "return losses.mean()")],
        catches=[CE],
        why="ignored targets are counted in the mean's denominator",
    ),
    dict(
        name="ce_ignore_index_hardcoded",
        cell="vocab_parallel_cross_entropy",
        replace=[("valid = target != ignore_index", "valid = target != -100")],
        catches=[CE],
        why="ignore_index ignored: -100 hard-coded (hidden: ignore_index=7)",
    ),
    dict(
        name="ce_uneven_vocab_ignored",
        cell="vocab_parallel_cross_entropy",
        replace=[("    if vocab_size is None:\n        start, stop = rank * local, (rank + 1) * local\n"
                  "    else:\n        start, stop = shard_range(vocab_size, rank, t)\n",
                  "    start, stop = rank * local, (rank + 1) * local\n")],
        catches=[CE],
        why="slices assumed equal: with a vocabulary that does not divide evenly, later ranks' ids are off (hidden)",
    ),

    # ------------------------------------------------------------------ sp_gather
    dict(
        name="sp_gather_backward_keeps_chunk",
        cell="sp_gather",
        replace=[("return sp_reduce_scatter(grad, ctx.group), None",
                  "return my_chunk(grad, 1, ctx.group).contiguous(), None")],
        catches=[SP_GATHER],
        why="backward keeps this rank's chunk of its own gradient: the other ranks' partial gradients are lost",
    ),
    dict(
        name="sp_gather_backward_all_reduce",
        cell="sp_gather",
        replace=[("return sp_reduce_scatter(grad, ctx.group), None",
                  "grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
                  "        return my_chunk(grad, 1, ctx.group).contiguous(), None")],
        catches=[SP_GATHER],
        why="backward all-reduces the whole gradient and keeps a chunk: right numbers, twice the traffic of a reduce-scatter",
    ),
    dict(
        name="sp_gather_along_batch",
        cell="sp_gather",
        replace=[("parts = x.movedim(1, 0).contiguous()", "parts = x.contiguous()"),
                 ("return out.movedim(0, 1).contiguous()", "return out")],
        catches=[SP_GATHER],
        why="all-gathers along dim 0, the batch, instead of the sequence",
    ),
    dict(
        name="sp_gather_without_group",
        cell="sp_gather",
        replace=[("t = dist.get_world_size(group)", "t = dist.get_world_size()"),
                 ("dist.all_gather_into_tensor(out, parts, group=group)", "dist.all_gather_into_tensor(out, parts)")],
        catches=[SP_GATHER],
        why="gathers over every rank instead of the group",
    ),

    # ------------------------------------------------------------------ sp_reduce_scatter
    dict(
        name="sp_rs_all_reduce_then_chunk",
        cell="sp_reduce_scatter",
        replace=[("        out = full.new_empty((full.shape[0] // t, *full.shape[1:]))\n"
                  "        dist.reduce_scatter_tensor(out, full, group=group)\n",
                  "        dist.all_reduce(full, group=group)\n"
                  "        out = full.tensor_split(t)[dist.get_rank(group)]\n")],
        catches=[SP_RS],
        why="all-reduce, then keep my chunk: right numbers, twice the bytes of a reduce-scatter",
    ),
    dict(
        name="sp_rs_backward_zero_padded",
        cell="sp_reduce_scatter",
        replace=[("return sp_gather(grad, ctx.group), None",
                  "t, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)\n"
                  "        full = grad.new_zeros((grad.shape[0], grad.shape[1] * t, *grad.shape[2:]))\n"
                  "        full.tensor_split(t, dim=1)[rank].copy_(grad)\n"
                  "        return full, None")],
        catches=[SP_RS],
        why="backward puts only my chunk's gradient back (zeros elsewhere): every token's input feeds every rank's sum",
    ),
    dict(
        name="sp_rs_along_batch",
        cell="sp_reduce_scatter",
        replace=[("full = x.movedim(1, 0).contiguous()", "full = x.contiguous()"),
                 ("return out.movedim(0, 1).contiguous()", "return out")],
        catches=[SP_RS],
        why="reduce-scatters along dim 0, the batch, instead of the sequence",
    ),

    # ------------------------------------------------------------------ sp_mlp_block
    dict(
        name="sp_ln_grads_not_reduced",
        cell="sp_mlp_block",
        replace=[("weight, bias = copy_to_tp(ln.weight, group), copy_to_tp(ln.bias, group)",
                  "weight, bias = ln.weight, ln.bias")],
        catches=[SP_BLOCK],
        why="LayerNorm's gradients left as each rank's partial sum over its own tokens",
    ),
    dict(
        name="sp_proj_bias_grad_not_reduced",
        cell="sp_mlp_block",
        replace=[("return x + y + copy_to_tp(mlp.proj.bias, group)", "return x + y + mlp.proj.bias")],
        catches=[SP_BLOCK],
        why="the output bias, added to a sequence shard, keeps a partial gradient",
    ),
    dict(
        name="sp_proj_bias_before_reduce_scatter",
        cell="sp_mlp_block",
        replace=[("y = sp_reduce_scatter(F.linear(h, my_chunk(mlp.proj.weight, 1, group)), group)",
                  "y = sp_reduce_scatter(F.linear(h, my_chunk(mlp.proj.weight, 1, group), mlp.proj.bias), group)"),
                 ("return x + y + copy_to_tp(mlp.proj.bias, group)", "return x + y")],
        catches=[SP_BLOCK],
        why="the output bias added on every rank before the reduce-scatter: counted t times",
    ),
    dict(
        name="sp_f_on_sequence_shard",
        cell="sp_mlp_block",
        replace=[("h = sp_gather(F.layer_norm(x, ", "h = sp_gather(F.layer_norm(copy_to_tp(x, group), ")],
        catches=[SP_BLOCK],
        why="an f on the sequence shard: backward adds other ranks' token gradients into mine",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
