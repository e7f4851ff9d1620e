"""Lab 5 (tensor and sequence parallelism): realistic wrong implementations, and correct
alternatives to the solution that must get full marks.

Each bug edits one solution cell of solutions/lab5_tensor_parallel/lab5_tensor_parallel.ipynb
and names the test cells that must lose points; each alternative rewrites one solution cell
correctly (format: solutions/BUGBANK.md).

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

    dict(
        name="g_in_place",
        cell="reduce_from_tp",
        replace=[("        out = x.clone()\n        dist.all_reduce(out, group=group)\n        return out\n",
                  "        dist.all_reduce(x, group=group)      # Megatron reduces in place\n        return x\n")],
        catches=[G_TEST],
        why="all-reduces the caller's tensor in place (the trap the lab warns about): the caller's partial sum is gone",
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
        name="attn_checks_query_heads_only",
        cell="tp_attention",
        replace=[("    if n_heads % t or n_kv % t:\n", "    if n_heads % t:\n")],
        catches=[ATTN],
        why="checks that t divides the query heads only: 12 query / 4 kv heads on t = 3 crash in view or hang",
    ),
    dict(
        name="attn_gqa_chunk3",
        cell="tp_attention",
        replace=[("    q, k, v = column_parallel_linear(x, weight, bias, group).split(\n"
                  "        [n_heads // t * hd, n_kv // t * hd, n_kv // t * hd], dim=-1)\n",
                  "    q, k, v = column_parallel_linear(x, weight, bias, group).chunk(3, dim=-1)\n")],
        catches=[ATTN],
        why="splits the fused QKV output with chunk(3): under GQA the K and V parts are smaller than Q's",
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

    dict(
        name="sp_rs_buffer_default_dtype",
        cell="sp_reduce_scatter",
        replace=[("out = full.new_empty((full.shape[0] // t, *full.shape[1:]))",
                  "out = torch.empty((full.shape[0] // t, *full.shape[1:]))")],
        catches=[SP_RS],
        why="output buffer in the default dtype (float32): fp64 and bf16 inputs abort in gloo or come back as fp32",
    ),
    dict(
        name="sp_gather_buffer_default_dtype",
        cell="sp_gather",
        replace=[("out = parts.new_empty((t * parts.shape[0], *parts.shape[1:]))",
                  "out = torch.empty((t * parts.shape[0], *parts.shape[1:]), device=x.device)")],
        catches=[SP_GATHER],
        why="gather buffer in the default dtype (float32): fp64 and bf16 shards do not fit it",
    ),
    dict(
        name="sp_gather_buffer_without_device",
        cell="sp_gather",
        replace=[("out = parts.new_empty((t * parts.shape[0], *parts.shape[1:]))",
                  "out = torch.empty((t * parts.shape[0], *parts.shape[1:]), dtype=parts.dtype)")],
        catches=["test_tp_device"],
        why="gather buffer made without device=: right on CPU ranks, a CPU output for NCCL's all-gather on a GPU "
            "node (only the device check sees it)",
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
    dict(
        name="sp_block_hooks_pile_up",
        cell="sp_mlp_block",
        code='''
class GatheredLinear(torch.autograd.Function):
    """Keeps only the sequence shard; all-gathers it again in backward (Korthikanti et al.)."""

    @staticmethod
    def forward(ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        return F.linear(sp_gather(x, group), w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        total = sp_gather(x, ctx.group)
        return (sp_reduce_scatter(grad @ w, ctx.group), grad.flatten(0, -2).T @ total.flatten(0, -2),
                grad.flatten(0, -2).sum(0), None)


def sp_mlp_block(x, ln, mlp, group=None):
    def summed(g):
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g

    for p in (ln.weight, ln.bias, mlp.proj.bias):
        p.register_hook(summed)
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    h = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    h = F.gelu(GatheredLinear.apply(h, mlp.fc.weight.tensor_split(t)[rank], mlp.fc.bias.tensor_split(t)[rank], group))
    y = sp_reduce_scatter(F.linear(h, mlp.proj.weight.tensor_split(t, dim=1)[rank]), group)
    return x + y + mlp.proj.bias
''',
        catches=[SP_BLOCK],
        why="hooks registered on the parameters at every call: the second step's partial gradients are all-reduced twice",
    ),
]

# Correct implementations other than the solution's: each must get full marks (the checks must
# not over-constrain). Among them the lab's "Going further" variants of graded functions (the SP
# block that re-gathers its input in backward, partial gradients summed by hooks, the cross
# entropy with two of its all-reduces fused) and the forms the notebook calls accepted (in-place
# g, dist.all_gather / dist.reduce_scatter on lists).
ALTERNATIVES = [
    # ------------------------------------------------------------------ copy_to_tp (f)
    dict(
        name="f_forward_returns_input",
        cell="copy_to_tp",
        replace=[("return x.view_as(x)           # a new tensor object (autograd needs one), same storage",
                  "return x                      # Megatron's f returns its input as it is")],
        why="forward returns x itself (Megatron's _CopyToModelParallelRegion), not a view of it",
    ),
    dict(
        name="f_forward_copies",
        cell="copy_to_tp",
        replace=[("return x.view_as(x)           # a new tensor object (autograd needs one), same storage",
                  "return x.clone()")],
        why="forward returns a copy of x (out of place, one more activation) instead of a view",
    ),
    dict(
        name="f_as_a_gradient_hook",
        cell="copy_to_tp",
        code='''
def _sum_over_group(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def copy_to_tp(x, group=None):
    """f: enter a tensor-parallel region from a replicated activation."""
    y = x.view_as(x)                       # identity forward
    if y.requires_grad:                    # backward: the gradient reaching y is all-reduced on its way to x
        y.register_hook(lambda grad: _sum_over_group(grad, group))
    return y
''',
        why="no autograd.Function: an identity view whose gradient hook all-reduces the gradient",
    ),

    # ------------------------------------------------------------------ reduce_from_tp (g)
    dict(
        name="g_functional_all_reduce",
        cell="reduce_from_tp",
        code='''
import torch.distributed._functional_collectives as funcol


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (a functional collective, out of place), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group if group is not None else dist.group.WORLD) * 1

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_from_tp(x, group=None):
    """g: leave a tensor-parallel region by summing the per-rank partial results."""
    return ReduceFromTP.apply(x, group)
''',
        why="torch's functional collectives (funcol.all_reduce, out of place): traced like dist.all_reduce",
    ),
    dict(
        name="g_async_all_reduce",
        cell="reduce_from_tp",
        replace=[("        dist.all_reduce(out, group=group)\n",
                  "        work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True)\n"
                  "        work.wait()\n")],
        why="posts the all-reduce with async_op=True and waits on its work handle",
    ),
    dict(
        name="g_detached_sum_plus_zero",
        cell="reduce_from_tp",
        code='''
def reduce_from_tp(x, group=None):
    """g: leave a tensor-parallel region by summing the per-rank partial results."""
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return total + (x - x.detach())        # value: the sum; gradient: the identity, through x - x.detach() (= 0)
''',
        why="no autograd.Function: a detached all-reduce plus x - x.detach(), whose gradient is the identity",
    ),

    # ------------------------------------------------------------------ column_parallel_linear
    dict(
        name="column_matmul",
        cell="column_parallel_linear",
        replace=[("    return F.linear(copy_to_tp(x, group), weight, bias)",
                  "    y = copy_to_tp(x, group) @ weight.t()\n    return y if bias is None else y + bias\n")],
        why="x @ Wᵀ (+ b) with the matmul operator instead of F.linear",
    ),
    dict(
        name="column_addmm_on_flat_tokens",
        cell="column_parallel_linear",
        replace=[("    return F.linear(copy_to_tp(x, group), weight, bias)",
                  "    x2 = copy_to_tp(x, group).reshape(-1, x.shape[-1])         # (tokens, in)\n"
                  "    y = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())\n"
                  "    return y.view(*x.shape[:-1], weight.shape[0])\n")],
        why="tokens flattened to 2-D, one addmm (bias fused), viewed back to (..., out/t)",
    ),
    dict(
        name="column_einsum",
        cell="column_parallel_linear",
        replace=[("    return F.linear(copy_to_tp(x, group), weight, bias)",
                  "    y = torch.einsum('...i,oi->...o', copy_to_tp(x, group), weight)\n"
                  "    return y if bias is None else y + bias\n")],
        why="the sharded matmul as an einsum",
    ),

    # ------------------------------------------------------------------ row_parallel_linear
    dict(
        name="row_matmul",
        cell="row_parallel_linear",
        replace=[("y = reduce_from_tp(F.linear(x, weight), group)", "y = reduce_from_tp(x @ weight.t(), group)")],
        why="the partial sum X_r W_rᵀ with the matmul operator instead of F.linear",
    ),
    dict(
        name="row_flat_tokens_then_view",
        cell="row_parallel_linear",
        replace=[("    y = reduce_from_tp(F.linear(x, weight), group)\n    return y if bias is None else y + bias",
                  "    partial = x.reshape(-1, x.shape[-1]) @ weight.t()             # (tokens, out)\n"
                  "    y = reduce_from_tp(partial, group).view(*x.shape[:-1], weight.shape[0])\n"
                  "    if bias is not None:\n        y = y + bias\n    return y\n")],
        why="tokens flattened to 2-D, g on the 2-D partial sum, viewed back, then the bias",
    ),
    dict(
        name="row_einsum_bias_via_add",
        cell="row_parallel_linear",
        replace=[("    y = reduce_from_tp(F.linear(x, weight), group)\n    return y if bias is None else y + bias",
                  "    y = reduce_from_tp(torch.einsum('...i,oi->...o', x, weight), group)\n"
                  "    return y if bias is None else torch.add(y, bias)\n")],
        why="einsum for the partial sum, torch.add for the bias after g",
    ),

    # ------------------------------------------------------------------ tp_mlp
    dict(
        name="mlp_inline_f_and_g",
        cell="tp_mlp",
        code='''
def tp_mlp(x, mlp, group=None):
    """proj(GeLU(fc(x))) with fc column-parallel and proj row-parallel over `group`."""
    h = F.gelu(F.linear(copy_to_tp(x, group), my_chunk(mlp.fc.weight, 0, group), my_chunk(mlp.fc.bias, 0, group)))
    return reduce_from_tp(F.linear(h, my_chunk(mlp.proj.weight, 1, group)), group) + mlp.proj.bias
''',
        why="f, the two matmuls and g written out with F.linear instead of the layer functions",
    ),
    dict(
        name="mlp_shard_range_slices_and_module_gelu",
        cell="tp_mlp",
        code='''
def tp_mlp(x, mlp, group=None):
    """proj(GeLU(fc(x))) with fc column-parallel and proj row-parallel over `group`."""
    rank, t = group_rank_size(group)
    a, b = shard_range(mlp.fc.out_features, rank, t)          # my hidden features [a, b)
    h = mlp.act(column_parallel_linear(x, mlp.fc.weight[a:b], mlp.fc.bias[a:b], group))
    return row_parallel_linear(h, mlp.proj.weight[:, a:b], mlp.proj.bias, group)
''',
        why="slices from shard_range instead of my_chunk, and the module's own GeLU (mlp.act)",
    ),
    dict(
        name="mlp_proj_bias_added_outside",
        cell="tp_mlp",
        replace=[("return row_parallel_linear(F.gelu(h), my_chunk(mlp.proj.weight, 1, group), mlp.proj.bias, group)",
                  "return row_parallel_linear(F.gelu(h), my_chunk(mlp.proj.weight, 1, group), None, group) + mlp.proj.bias")],
        why="row-parallel layer without bias, proj.bias added once by the caller after it",
    ),

    # ------------------------------------------------------------------ tp_attention
    dict(
        name="attn_one_f_three_matmuls",
        cell="tp_attention",
        replace=[("    weight = torch.cat([my_chunk(lin.weight, 0, group) for lin in (attn.q, attn.k, attn.v)])\n"
                  "    bias = torch.cat([my_chunk(lin.bias, 0, group) for lin in (attn.q, attn.k, attn.v)])\n"
                  "    q, k, v = column_parallel_linear(x, weight, bias, group).split(\n"
                  "        [n_heads // t * hd, n_kv // t * hd, n_kv // t * hd], dim=-1)\n",
                  "    xf = copy_to_tp(x, group)            # enter the region once: one all-reduce in backward\n"
                  "    q, k, v = (F.linear(xf, my_chunk(lin.weight, 0, group), my_chunk(lin.bias, 0, group))\n"
                  "               for lin in (attn.q, attn.k, attn.v))\n")],
        why="one f on x, then three separate matmuls for Q, K, V (no fused weight): still one all-reduce backward",
    ),
    dict(
        name="attn_sdpa",
        cell="tp_attention",
        replace=[("    y = causal_attention(heads(q), heads(k), heads(v), attn.future)\n",
                  "    y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, enable_gqa=True)\n")],
        why="local attention with F.scaled_dot_product_attention (is_causal, enable_gqa) instead of causal_attention",
    ),
    dict(
        name="attn_head_ranges_and_explicit_softmax",
        cell="tp_attention",
        code='''
def tp_attention(x, attn, group=None):
    """Causal self-attention with this rank's whole heads: fused QKV column-parallel, local
    attention, o row-parallel (o.bias whole, added once)."""
    rank, t = group_rank_size(group)
    hd = attn.head_dim
    n_heads, n_kv = attn.q.out_features // hd, attn.k.out_features // hd
    if n_heads % t or n_kv % t:
        raise ValueError(f"cannot split {n_heads} query / {n_kv} kv heads over {t} ranks")
    qa, qb = (hd * i for i in shard_range(n_heads, rank, t))      # rows of my query heads
    ka, kb = (hd * i for i in shard_range(n_kv, rank, t))         # rows of my kv heads
    weight = torch.cat([attn.q.weight[qa:qb], attn.k.weight[ka:kb], attn.v.weight[ka:kb]])
    bias = torch.cat([attn.q.bias[qa:qb], attn.k.bias[ka:kb], attn.v.bias[ka:kb]])
    b, s, _ = x.shape
    qkv = column_parallel_linear(x, weight, bias, group)
    q = qkv[..., :qb - qa].view(b, s, -1, hd).transpose(1, 2)
    k, v = (z.view(b, s, -1, hd).transpose(1, 2) for z in qkv[..., qb - qa:].chunk(2, dim=-1))
    k, v = (z.repeat_interleave(q.size(1) // z.size(1), dim=1) for z in (k, v))   # GQA: query head i reads kv i // g
    scores = (q @ k.transpose(-2, -1)) * hd ** -0.5
    probs = scores.masked_fill(attn.future[:s, :s], float("-inf")).softmax(dim=-1)
    y = (probs @ v).transpose(1, 2).reshape(b, s, -1)
    return row_parallel_linear(y, attn.o.weight[:, qa:qb], attn.o.bias, group)
''',
        why="head ranges from shard_range and slicing, GQA by repeat_interleave, softmax attention written out",
    ),

    # ------------------------------------------------------------------ vocab_parallel_cross_entropy
    dict(
        name="ce_two_all_reduces",
        cell="vocab_parallel_cross_entropy",
        code='''
def vocab_parallel_cross_entropy(logits, target, group=None, ignore_index=-100, *, vocab_size=None):
    """Mean cross entropy of logits split by vocabulary over `group` (the last two all-reduces fused)."""
    rank, t = group_rank_size(group)
    local = logits.shape[-1]
    start, stop = (rank * local, (rank + 1) * local) if vocab_size is None else shard_range(vocab_size, rank, t)
    m = logits.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    valid = target != ignore_index
    mine = valid & (target >= start) & (target < stop)
    picked = shifted.gather(-1, (target - start).masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1) * mine
    both = reduce_from_tp(torch.stack([picked, shifted.exp().sum(-1)], -1), group)   # one all-reduce of 2 per token
    return ((both[..., 1].log() - both[..., 0]) * valid).sum() / valid.sum()
''',
        why="Going further: the target logit and the sum of exp stacked into one all-reduce (two collectives, not three)",
    ),
    dict(
        name="ce_one_hot_target",
        cell="vocab_parallel_cross_entropy",
        code='''
def vocab_parallel_cross_entropy(logits, target, group=None, ignore_index=-100, *, vocab_size=None):
    """Mean cross entropy of logits split by vocabulary over `group` (three all-reduces forward)."""
    rank, t = group_rank_size(group)
    if vocab_size is None:
        vocab_size = t * logits.shape[-1]
    start, stop = shard_range(vocab_size, rank, t)
    ids = torch.arange(start, stop, device=logits.device)      # the global ids of my columns
    m = logits.detach().amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m[..., None]
    one_hot = (target[..., None] == ids).to(logits.dtype)      # all zeros where the target is not mine
    target_logit = reduce_from_tp((shifted * one_hot).sum(-1), group)
    sum_exp = reduce_from_tp(shifted.exp().sum(-1), group)
    losses = sum_exp.log() - target_logit
    valid = target != ignore_index
    return losses[valid].mean()
''',
        why="the target logit picked by a one-hot comparison with my ids (no gather/masking), mean over losses[valid]",
    ),
    dict(
        name="ce_combines_local_logsumexps",
        cell="vocab_parallel_cross_entropy",
        code='''
def vocab_parallel_cross_entropy(logits, target, group=None, ignore_index=-100, *, vocab_size=None):
    """Mean cross entropy of logits split by vocabulary over `group` (three all-reduces forward)."""
    rank, t = group_rank_size(group)
    local = logits.shape[-1]
    start, stop = (rank * local, (rank + 1) * local) if vocab_size is None else shard_range(vocab_size, rank, t)
    lse_mine = torch.logsumexp(logits, dim=-1)                  # log Σ over my slice, stable
    m = lse_mine.detach().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)        # the largest slice lse
    lse = m + reduce_from_tp(torch.exp(lse_mine - m), group).log()
    valid = target != ignore_index
    mine = valid & (target >= start) & (target < stop)
    idx = torch.where(mine, target - start, torch.zeros_like(target))
    z_y = reduce_from_tp(torch.where(mine, logits.gather(-1, idx[..., None]).squeeze(-1), torch.zeros_like(lse)), group)
    losses = torch.where(valid, lse - z_y, torch.zeros_like(lse))
    return losses.sum() / valid.sum()
''',
        why="each rank's logsumexp of its slice, combined over the group (max of the lse's, sum of exp), unshifted z_y",
    ),

    # ------------------------------------------------------------------ sp_gather
    dict(
        name="sp_gather_with_a_list",
        cell="sp_gather",
        replace=[("        t = dist.get_world_size(group)\n"
                  "        parts = x.movedim(1, 0).contiguous()                     # (s/t, b, h): the sequence in front\n"
                  "        out = parts.new_empty((t * parts.shape[0], *parts.shape[1:]))\n"
                  "        dist.all_gather_into_tensor(out, parts, group=group)\n"
                  "        return out.movedim(0, 1).contiguous()\n",
                  "        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]\n"
                  "        dist.all_gather(parts, x.contiguous(), group=group)\n"
                  "        return torch.cat(parts, dim=1)\n")],
        why="dist.all_gather into a list of shards, concatenated along the sequence",
    ),
    dict(
        name="sp_gather_stacked_own_reduce_scatter",
        cell="sp_gather",
        code='''
class SPGather(torch.autograd.Function):
    """All-gather along the sequence (dim 1) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = dist.get_world_size(group)
        out = x.new_empty((t, *x.shape))                        # (t, b, s/t, h): rank j's shard in out[j]
        dist.all_gather_into_tensor(out, x.unsqueeze(0).contiguous(), group=group)   # dim 0: 1 per rank
        return torch.cat(out.unbind(0), dim=1)

    @staticmethod
    def backward(ctx, grad):
        t = dist.get_world_size(ctx.group)
        chunks = torch.stack(grad.tensor_split(t, dim=1))      # (t, b, s/t, h): chunk j is rank j's
        out = chunks.new_empty((1, *chunks.shape[1:]))
        dist.reduce_scatter_tensor(out, chunks, group=ctx.group)
        return out.squeeze(0), None


def sp_gather(x, group=None):
    """(b, s/t, h) this rank's tokens -> (b, s, h) every rank's, in rank order."""
    return SPGather.apply(x, group)
''',
        why="gathers into a (t, ...) buffer (no movedim) and reduce-scatters in its own backward, not via sp_reduce_scatter",
    ),
    dict(
        name="sp_gather_backward_list_reduce_scatter",
        cell="sp_gather",
        replace=[("        return sp_reduce_scatter(grad, ctx.group), None\n",
                  "        t = dist.get_world_size(ctx.group)\n"
                  "        chunks = [c.contiguous() for c in grad.tensor_split(t, dim=1)]\n"
                  "        out = torch.empty_like(chunks[0])\n"
                  "        dist.reduce_scatter(out, chunks, group=ctx.group)\n"
                  "        return out, None\n")],
        why="backward written out with dist.reduce_scatter on a list of sequence chunks",
    ),

    dict(
        name="sp_gather_functional_collectives",
        cell="sp_gather",
        code='''
import torch.distributed._functional_collectives as funcol

# torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to *_single (the old names warn there)
gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


class SPGather(torch.autograd.Function):
    """All-gather along the sequence (dim 1) forward; reduce-scatter backward, with functional collectives."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group if group is not None else dist.group.WORLD
        parts = x.movedim(1, 0).contiguous()                       # the sequence in front
        return gather(parts, 0, ctx.group).movedim(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        full = grad.movedim(1, 0).contiguous()
        return scatter(full, "sum", 0, ctx.group).movedim(0, 1).contiguous(), None


def sp_gather(x, group=None):
    """(b, s/t, h) this rank's tokens -> (b, s, h) every rank's, in rank order."""
    return SPGather.apply(x, group)
''',
        why="torch.distributed._functional_collectives (all_gather_single / reduce_scatter_single, before torch 2.13 all_gather_tensor / reduce_scatter_tensor): traced like dist.*",
    ),

    # ------------------------------------------------------------------ sp_reduce_scatter
    dict(
        name="sp_rs_with_a_list",
        cell="sp_reduce_scatter",
        replace=[("        full = x.movedim(1, 0).contiguous()                      # (s, b, h)\n"
                  "        out = full.new_empty((full.shape[0] // t, *full.shape[1:]))\n"
                  "        dist.reduce_scatter_tensor(out, full, group=group)\n"
                  "        return out.movedim(0, 1).contiguous()\n",
                  "        chunks = [c.contiguous() for c in x.tensor_split(t, dim=1)]\n"
                  "        out = torch.empty_like(chunks[0])\n"
                  "        dist.reduce_scatter(out, chunks, group=group)\n"
                  "        return out\n")],
        why="dist.reduce_scatter on a list of sequence chunks",
    ),
    dict(
        name="sp_rs_stacked_own_all_gather",
        cell="sp_reduce_scatter",
        code='''
class SPReduceScatter(torch.autograd.Function):
    """Reduce-scatter along the sequence (dim 1) forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = dist.get_world_size(group)
        chunks = torch.stack(x.tensor_split(t, dim=1))         # (t, b, s/t, h), contiguous
        out = chunks.new_empty((1, *chunks.shape[1:]))          # dim 0: t chunks in, 1 out per rank
        dist.reduce_scatter_tensor(out, chunks, group=group)
        return out.squeeze(0)

    @staticmethod
    def backward(ctx, grad):
        t = dist.get_world_size(ctx.group)
        full = grad.new_empty((t, *grad.shape))
        dist.all_gather_into_tensor(full, grad.unsqueeze(0).contiguous(), group=ctx.group)
        return torch.cat(full.unbind(0), dim=1), None


def sp_reduce_scatter(x, group=None):
    """(b, s, h) a partial sum -> (b, s/t, h) my tokens of the sum over the group."""
    return SPReduceScatter.apply(x, group)
''',
        why="chunks stacked into (t, ...) (no movedim), and its own all-gather in backward instead of sp_gather",
    ),
    dict(
        name="sp_rs_backward_list_all_gather",
        cell="sp_reduce_scatter",
        replace=[("        return sp_gather(grad, ctx.group), None\n",
                  "        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]\n"
                  "        dist.all_gather(parts, grad.contiguous(), group=ctx.group)\n"
                  "        return torch.cat(parts, dim=1), None\n")],
        why="backward written out with dist.all_gather on a list, concatenated along the sequence",
    ),

    # ------------------------------------------------------------------ sp_mlp_block
    dict(
        name="sp_block_regather_in_backward",
        cell="sp_mlp_block",
        code='''
class GatheredColumnLinear(torch.autograd.Function):
    """fc under SP: all-gather the shard for the matmul, save only the shard, all-gather it again in backward."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        ctx.save_for_backward(shard, weight)
        ctx.group = group
        return F.linear(sp_gather(shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        full = sp_gather(shard, ctx.group)                       # the re-gather (Megatron overlaps it with dX)
        grad_input = sp_reduce_scatter(grad @ weight, ctx.group)
        g2 = grad.reshape(-1, grad.shape[-1])
        return grad_input, g2.t() @ full.reshape(-1, full.shape[-1]), g2.sum(0), None


def sp_mlp_block(x, ln, mlp, group=None):
    """x + mlp(ln(x)) on this rank's sequence shard (b, s/t, h), tensor-parallel MLP in between."""
    weight, bias = copy_to_tp(ln.weight, group), copy_to_tp(ln.bias, group)
    h = F.layer_norm(x, ln.normalized_shape, weight, bias, ln.eps)
    h = F.gelu(GatheredColumnLinear.apply(h, my_chunk(mlp.fc.weight, 0, group), my_chunk(mlp.fc.bias, 0, group), group))
    y = sp_reduce_scatter(F.linear(h, my_chunk(mlp.proj.weight, 1, group)), group)
    return x + y + copy_to_tp(mlp.proj.bias, group)
''',
        why="Going further: fc keeps only the (b, s/t, h) shard for backward and all-gathers it again there (f on the partial-grad params)",
    ),
    dict(
        name="sp_block_partial_grads_by_hooks",
        cell="sp_mlp_block",
        code='''
def sp_mlp_block(x, ln, mlp, group=None):
    """x + mlp(ln(x)) on this rank's sequence shard (b, s/t, h), tensor-parallel MLP in between."""
    def summed(grad):                      # the partial gradient over my tokens -> over the group's
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    # hooks on this call's aliases of the parameters (a hook on the parameter itself would pile up, one per call)
    ln_w, ln_b, proj_b = (p.view_as(p) for p in (ln.weight, ln.bias, mlp.proj.bias))
    for p in (ln_w, ln_b, proj_b):
        p.register_hook(summed)
    h = sp_gather(F.layer_norm(x, ln.normalized_shape, ln_w, ln_b, ln.eps), group)
    h = F.gelu(F.linear(h, my_chunk(mlp.fc.weight, 0, group), my_chunk(mlp.fc.bias, 0, group)))
    y = sp_reduce_scatter(F.linear(h, my_chunk(mlp.proj.weight, 1, group)), group)
    return x + y + proj_b
''',
        why="Going further: no f; gradient hooks all-reduce the partial gradients of ln.weight, ln.bias, proj.bias",
    ),
    dict(
        name="sp_block_partial_grads_one_all_reduce",
        cell="sp_mlp_block",
        code='''
class SumPartialGrads(torch.autograd.Function):
    """Identity forward on several parameters; backward all-reduces their gradients in ONE flat buffer."""

    @staticmethod
    def forward(ctx, group, *params):
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        return (None, *(f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)))


def sp_mlp_block(x, ln, mlp, group=None):
    """x + mlp(ln(x)) on this rank's sequence shard (b, s/t, h), tensor-parallel MLP in between."""
    weight, bias, proj_bias = SumPartialGrads.apply(group, ln.weight, ln.bias, mlp.proj.bias)
    h = sp_gather(F.layer_norm(x, ln.normalized_shape, weight, bias, ln.eps), group)
    h = F.gelu(F.linear(h, my_chunk(mlp.fc.weight, 0, group), my_chunk(mlp.fc.bias, 0, group)))
    y = sp_reduce_scatter(F.linear(h, my_chunk(mlp.proj.weight, 1, group)), group)
    return x + y + proj_bias
''',
        why="the 3h partial-gradient numbers flattened into one buffer and all-reduced in one call (Megatron's way)",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
