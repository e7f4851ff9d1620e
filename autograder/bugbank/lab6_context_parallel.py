"""Lab 6 (context parallelism: Ulysses and ring attention): realistic wrong implementations.

Each bug edits one solution cell of solutions/lab6_context_parallel/lab6_context_parallel.ipynb
and names the test cells that must lose points (format: autograder/bugbank/README.md).

While one function is graded, the checks stand minidist's own in for the lab's other functions
(minidist.checks.lab6_context_parallel), so a wrong all-to-all fails its own test only, not
Ulysses' too, and a wrong merge fails the merge's test, not the ring's. Some bugs give the right
numbers and the wrong messages (K/V sent the wrong way round the ring): the traced traffic
catches those. One bug deadlocks only when isend/irecv block until matched (NCCL's strictest
case): it costs the check's timeout, on the ring's test alone.
"""

A2A = "test_all_to_all"
ULYSSES = "test_ulysses_attention"
MERGE = "test_merge_partial_attention"
RING = "test_ring_attention_forward"
ZIGZAG = "test_zigzag_shard"

BUGS = [
    # ------------------------------------------------------------------ all_to_all
    dict(
        name="a2a_dims_swapped",
        cell="all_to_all",
        replace=[("        return exchange_chunks(x, scatter_dim, gather_dim, group)\n",
                  "        return exchange_chunks(x, gather_dim, scatter_dim, group)\n")],
        catches=[A2A],
        why="forward scatters the gather dim and gathers the scatter dim",
    ),
    dict(
        name="a2a_backward_not_swapped",
        cell="all_to_all",
        replace=[("return exchange_chunks(grad, gather_dim, scatter_dim, ctx.group)",
                  "return exchange_chunks(grad, scatter_dim, gather_dim, ctx.group)")],
        catches=[A2A],
        why="backward repeats the forward all-to-all instead of its inverse (dims not swapped)",
    ),
    dict(
        name="a2a_concat_along_scatter_dim",
        cell="all_to_all",
        replace=[("return torch.cat(recv.unbind(0), dim=gather_dim)", "return torch.cat(recv.unbind(0), dim=scatter_dim)")],
        catches=[A2A],
        why="the received chunks are put back along the scatter dim: nothing is gathered",
    ),
    dict(
        name="a2a_backward_identity",
        cell="all_to_all",
        replace=[("return exchange_chunks(grad, gather_dim, scatter_dim, ctx.group), None, None, None",
                  "return grad, None, None, None")],
        catches=[A2A],
        why="backward returns the gradient as it came: it never travels back to the ranks that sent the data",
    ),
    dict(
        name="a2a_no_divisibility_check",
        cell="all_to_all",
        replace=[("    if x.shape[scatter_dim] % p:\n        raise ValueError(f\"dim {scatter_dim} of size "
                  "{x.shape[scatter_dim]} does not split over {p} ranks\")\n", "")],
        catches=[A2A],
        why="no ValueError when the scatter dim does not split: chunk() makes unequal chunks and the exchange breaks",
    ),

    # ------------------------------------------------------------------ ulysses_attention
    dict(
        name="ulysses_scatters_the_sequence",
        cell="ulysses_attention",
        replace=[("all_to_all(x, 2, 1, group).transpose(1, 2)", "all_to_all(x, 1, 2, group).transpose(1, 2)"),
                 ("return all_to_all(out.transpose(1, 2), 1, 2, group)", "return all_to_all(out.transpose(1, 2), 2, 1, group)")],
        catches=[ULYSSES],
        why="scatter and gather dims swapped both ways: each rank attends over a slice of the sequence with every head",
    ),
    dict(
        name="ulysses_missing_scale",
        cell="ulysses_attention",
        replace=[("is_causal=causal, enable_gqa=True)", "is_causal=causal, enable_gqa=True, scale=1.0)")],
        catches=[ULYSSES],
        why="scores not divided by sqrt(d)",
    ),
    dict(
        name="ulysses_causal_ignored",
        cell="ulysses_attention",
        replace=[("is_causal=causal, enable_gqa=True)", "enable_gqa=True)")],
        catches=[ULYSSES],
        why="the causal flag is never passed to the local attention",
    ),
    dict(
        name="ulysses_output_not_returned_to_sequence_shards",
        cell="ulysses_attention",
        replace=[("return all_to_all(out.transpose(1, 2), 1, 2, group)",
                  "return out.transpose(1, 2).reshape(q.shape)")],
        catches=[ULYSSES],
        why="no inverse all-to-all: the head-sharded output is reshaped into a sequence shard",
    ),
    dict(
        name="ulysses_gqa_heads_not_matched",
        cell="ulysses_attention",
        replace=[("is_causal=causal, enable_gqa=True)", "is_causal=causal)")],
        catches=[ULYSSES],
        why="grouped-query attention not handled: fewer kv heads than query heads break the local attention",
    ),

    # ------------------------------------------------------------------ merge_partial_attention
    dict(
        name="merge_adds_lses",
        cell="merge_partial_attention",
        replace=[("lse = torch.maximum(lse_a, lse_b) - F.logsigmoid((lse_a - lse_b).abs())", "lse = lse_a + lse_b")],
        catches=[MERGE],
        why="the lse's added: the log of the product of the denominators, not of their sum",
    ),
    dict(
        name="merge_exp_without_max",
        cell="merge_partial_attention",
        code='''
def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of A and B, from each one's (out, lse)."""
    total = torch.exp(lse_a) + torch.exp(lse_b)
    out = (torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b) / total[..., None]
    return out, torch.log(total)
''',
        catches=[MERGE],
        why="the textbook merge without the max: exp overflows once the lse's pass ~89 (fp32), inf/inf = nan",
    ),
    dict(
        name="merge_weights_swapped",
        cell="merge_partial_attention",
        replace=[("torch.sigmoid(lse_b - lse_a)", "torch.sigmoid(lse_a - lse_b)")],
        catches=[MERGE],
        why="sigmoid of the wrong difference: each side weighted by the other's share",
    ),
    dict(
        name="merge_lse_is_max",
        cell="merge_partial_attention",
        replace=[("lse = torch.maximum(lse_a, lse_b) - F.logsigmoid((lse_a - lse_b).abs())",
                  "lse = torch.maximum(lse_a, lse_b)")],
        catches=[MERGE],
        why="the lse keeps only the larger side: the log(1 + e^-|diff|) term is dropped",
    ),

    # ------------------------------------------------------------------ ring_attention_forward
    dict(
        name="ring_causal_mask_on_every_block",
        cell="ring_attention_forward",
        replace=[("causal=causal and src == rank)", "causal=causal)")],
        catches=[RING],
        why="every visible block gets the triangular mask, earlier blocks too",
    ),
    dict(
        name="ring_causal_mask_on_no_block",
        cell="ring_attention_forward",
        replace=[("causal=causal and src == rank)", "causal=False)")],
        catches=[RING],
        why="the diagonal block is not masked: queries see later tokens of their own block",
    ),
    dict(
        name="ring_later_blocks_not_skipped",
        cell="ring_attention_forward",
        replace=[("        if not causal or src <= rank:", "        if True:")],
        catches=[RING],
        why="causal, but the blocks of later tokens are attended to in full instead of skipped",
    ),
    dict(
        name="ring_kv_passed_the_wrong_way",
        cell="ring_attention_forward",
        replace=[("dist.isend(kv, dst=global_rank(group, (rank + 1) % p)", "dist.isend(kv, dst=global_rank(group, (rank - 1) % p)"),
                 ("dist.irecv(incoming, src=global_rank(group, (rank - 1) % p)",
                  "dist.irecv(incoming, src=global_rank(group, (rank + 1) % p)")],
        catches=[RING],
        why="K/V go to r-1 and come from r+1 while src assumes the other direction: causal blocks mis-masked",
    ),
    dict(
        name="ring_everyone_sends_first",
        cell="ring_attention_forward",
        replace=[("works = [send(), recv()] if rank % 2 == 0 else [recv(), send()]", "works = [send(), recv()]")],
        catches=[RING],
        why="every rank posts its send first: fine under gloo, deadlocks when sends block until matched (NCCL)",
    ),
    dict(
        name="ring_no_merge",
        cell="ring_attention_forward",
        replace=[("out, lse = (out_b, lse_b) if out is None else merge_partial_attention(out, lse, out_b, lse_b)",
                  "out, lse = out_b, lse_b")],
        catches=[RING],
        why="each block's result overwrites the running one instead of being merged",
    ),
    dict(
        name="ring_src_off_by_direction",
        cell="ring_attention_forward",
        replace=[("src = (rank - step) % p", "src = (rank + step) % p")],
        catches=[RING],
        why="the block held at step i is taken to be rank r+i's: causal masks and skips land on the wrong blocks",
    ),

    # ------------------------------------------------------------------ zigzag_shard
    dict(
        name="zigzag_late_chunk_off_by_one",
        cell="zigzag_shard",
        replace=[("chunks[2 * p - 1 - rank]", "chunks[2 * p - rank - 2]")],
        catches=[ZIGZAG],
        why="the late chunk is 2P-2-r instead of 2P-1-r",
    ),
    dict(
        name="zigzag_pairs_r_and_r_plus_p",
        cell="zigzag_shard",
        replace=[("chunks[2 * p - 1 - rank]", "chunks[rank + p]")],
        catches=[ZIGZAG],
        why="chunks r and r+P (striped by halves): every rank's second chunk is late by the same amount, no balance",
    ),
    dict(
        name="zigzag_contiguous",
        cell="zigzag_shard",
        replace=[("    chunks = x.chunk(2 * p, dim=1)\n    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim=1)",
                  "    return x.chunk(p, dim=1)[rank]")],
        catches=[ZIGZAG],
        why="the contiguous shard r of P: the layout zigzag is meant to replace",
    ),
    dict(
        name="zigzag_along_the_batch",
        cell="zigzag_shard",
        replace=[("    chunks = x.chunk(2 * p, dim=1)\n    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim=1)",
                  "    chunks = x.chunk(2 * p, dim=0)\n    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim=0)")],
        catches=[ZIGZAG],
        why="chunks cut along dim 0, the batch, instead of the sequence",
    ),
    dict(
        name="zigzag_no_value_error",
        cell="zigzag_shard",
        replace=[("    if x.size(1) % (2 * p):\n        raise ValueError(f\"a sequence of {x.size(1)} tokens does not cut "
                  "into 2P = {2 * p} equal chunks\")\n", "")],
        catches=[ZIGZAG],
        why="no ValueError when s is not divisible by 2P: chunk() silently makes unequal (or fewer) chunks",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
