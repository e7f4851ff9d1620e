"""Lab 6 (context parallelism: Ulysses and ring attention): realistic wrong implementations, and
correct alternatives to the solution that must get full marks.

Each bug edits one solution cell of solutions/lab6_context_parallel/lab6_context_parallel.ipynb
and names the test cells that must lose points; each alternative rewrites one solution cell
correctly (format: solutions/BUGBANK.md).

While one function is graded, the checks stand minidist's own in for the lab's other functions
(minidist.checks.lab6_context_parallel), so a wrong all-to-all fails its own test only, not
Ulysses' too, and a wrong merge fails the merge's test, not the ring's. Some bugs give the right
numbers and the wrong messages (K/V sent the wrong way round the ring): the traced traffic
catches those; a ring that waits for the next block before computing the current one gives the
right numbers too, and a peer that starts late shows it. One bug deadlocks only when isend/irecv
block until matched (NCCL's strictest case, in the visible test too): it costs the check's
timeout, on the ring's test alone.
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
    dict(
        name="ulysses_checks_query_heads_only",
        cell="ulysses_attention",
        replace=[("if q.size(2) % p or k.size(2) % p:", "if q.size(2) % p:")],
        catches=[ULYSSES],
        why="only the query heads are checked: 8 query and 2 kv heads on 4 ranks send q's all-to-all, then fail on k",
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
    dict(
        name="merge_in_float32",
        cell="merge_partial_attention",
        code='''
def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of A and B, from each one's (out, lse)."""
    a, b, la, lb = (x.float() for x in (out_a, out_b, lse_a, lse_b))      # "float32 is enough"
    out = a - torch.sigmoid(lb - la)[..., None] * (a - b)
    lse = torch.maximum(la, lb) - F.logsigmoid((la - lb).abs())
    return out.to(out_a.dtype), lse.to(lse_a.dtype)
''',
        catches=[MERGE],
        why="computed in float32 whatever the inputs: float64 inputs come back in float64 but only float32-exact",
    ),
    dict(
        name="merge_in_place_into_out_a",
        cell="merge_partial_attention",
        replace=[("out = out_a - torch.sigmoid(lse_b - lse_a)[..., None] * (out_a - out_b)",
                  "out = out_a.sub_(torch.sigmoid(lse_b - lse_a)[..., None] * (out_a - out_b))")],
        catches=[MERGE],
        why="the merge written into out_a in place: the caller's partial result is overwritten",
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
        name="ring_waits_for_the_send_only",
        cell="ring_attention_forward",
        replace=[("            for w in works:\n                w.wait()\n",
                  "            works[rank % 2].wait()        # my block has left, so my neighbour's has arrived\n")],
        catches=[RING],
        why="waits for its own send only and computes on the next block whenever it happens to have arrived",
    ),
    dict(
        name="ring_src_off_by_direction",
        cell="ring_attention_forward",
        replace=[("src = (rank - step) % p", "src = (rank + step) % p")],
        catches=[RING],
        why="the block held at step i is taken to be rank r+i's: causal masks and skips land on the wrong blocks",
    ),
    dict(
        name="ring_output_in_the_helpers_dtype",
        cell="ring_attention_forward",
        replace=[("return out.transpose(1, 2).to(q.dtype), lse", "return out.transpose(1, 2), lse")],
        catches=[RING],
        why="out returned in the helper's float32: right for float32 and float64 inputs, wrong dtype for bfloat16",
    ),
    dict(
        name="ring_buffer_without_device",
        cell="ring_attention_forward",
        replace=[("            incoming = torch.empty_like(kv)\n",
                  "            incoming = torch.empty(kv.shape, dtype=kv.dtype)\n")],
        catches=["test_cp_device"],
        why="the receive buffer is made without device=: right on CPU ranks, a CPU buffer for NCCL's receive on a "
            "GPU node (only the device check sees it)",
    ),
    dict(
        name="ring_waits_before_compute",
        cell="ring_attention_forward",
        replace=[("        if not causal or src <= rank:                      # later blocks are invisible when causal\n"
                  "            out_b, lse_b = attention_with_lse(q, kv[0], kv[1], causal=causal and src == rank)\n"
                  "            out, lse = (out_b, lse_b) if out is None else merge_partial_attention(out, lse, out_b, lse_b)\n"
                  "        if step < p - 1:\n"
                  "            for w in works:\n"
                  "                w.wait()\n"
                  "            kv = incoming\n",
                  "            for w in works:                                # wait first: no overlap\n"
                  "                w.wait()\n"
                  "        if not causal or src <= rank:                      # kv is still the block of src\n"
                  "            out_b, lse_b = attention_with_lse(q, kv[0], kv[1], causal=causal and src == rank)\n"
                  "            out, lse = (out_b, lse_b) if out is None else merge_partial_attention(out, lse, out_b, lse_b)\n"
                  "        if step < p - 1:\n"
                  "            kv = incoming\n")],
        catches=[RING],
        why="right numbers, but the next block is waited for before the current one is computed: nothing overlaps "
            "(a late peer delays the first block's compute)",
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

# Correct implementations other than the solution's: each must get full marks (the checks must
# not over-constrain). Among them the forms the notebook calls accepted (dist.all_to_all on
# lists, q, k and v packed into fewer all-to-alls, a merge that subtracts the max, a ring on
# batch_isend_irecv or on blocking send/recv after each block's compute, k and v as two
# messages). The "Going further" ring whose waits come before the block's compute is a bug now:
# the lab asks for the overlap and a late peer measures it. (Zigzag ring attention, the other
# "Going further" ring, takes zigzag shards: it implements another function than the graded one.)
ALTERNATIVES = [
    # ------------------------------------------------------------------ all_to_all
    dict(
        name="a2a_list_all_to_all",
        cell="all_to_all",
        replace=[("    send = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()      # (P, ...): chunk j for rank j\n"
                  "    recv = torch.empty_like(send)\n"
                  "    dist.all_to_all_single(recv, send, group=group)\n"
                  "    return torch.cat(recv.unbind(0), dim=gather_dim)                  # rank j's piece in place j\n",
                  "    send = [c.contiguous() for c in x.tensor_split(p, dim=scatter_dim)]\n"
                  "    recv = [torch.empty_like(c) for c in send]\n"
                  "    dist.all_to_all(recv, send, group=group)\n"
                  "    return torch.cat(recv, dim=gather_dim)\n")],
        why="dist.all_to_all on lists of chunks instead of all_to_all_single on a stacked tensor",
    ),
    dict(
        name="a2a_movedim_reshape",
        cell="all_to_all",
        replace=[("    send = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()      # (P, ...): chunk j for rank j\n"
                  "    recv = torch.empty_like(send)\n"
                  "    dist.all_to_all_single(recv, send, group=group)\n"
                  "    return torch.cat(recv.unbind(0), dim=gather_dim)                  # rank j's piece in place j\n",
                  "    front = x.movedim(scatter_dim, 0)                                  # the scatter dim in front\n"
                  "    send = front.reshape(p, front.shape[0] // p, *front.shape[1:]).contiguous()\n"
                  "    recv = torch.empty_like(send)\n"
                  "    dist.all_to_all_single(recv, send, group=group)\n"
                  "    return torch.cat([c.movedim(0, scatter_dim) for c in recv.unbind(0)], dim=gather_dim)\n")],
        why="chunks made by moving the scatter dim in front and reshaping to (P, n/P, ...), moved back after",
    ),
    dict(
        name="a2a_backward_applies_itself",
        cell="all_to_all",
        replace=[("return exchange_chunks(grad, gather_dim, scatter_dim, ctx.group), None, None, None",
                  "return AllToAll.apply(grad, gather_dim, scatter_dim, ctx.group), None, None, None")],
        why="backward calls the autograd function with the dims swapped (twice differentiable) instead of the raw exchange",
    ),
    dict(
        name="a2a_no_group_of_one_shortcut",
        cell="all_to_all",
        replace=[("return x if p == 1 else AllToAll.apply(x, scatter_dim, gather_dim, group)",
                  "return AllToAll.apply(x, scatter_dim, gather_dim, group)     # a group of one exchanges with itself")],
        why="no shortcut for a group of one: the all-to-all runs there too (and returns the same tensor values)",
    ),

    # ------------------------------------------------------------------ ulysses_attention
    dict(
        name="ulysses_packed_qkv",
        cell="ulysses_attention",
        code='''
def ulysses_attention(q, k, v, causal=False, group=None):
    """Attention on sequence shards (b, s/P, h, d) through head shards; returns (b, s/P, h, d)."""
    p = dist.get_world_size(group)
    if q.size(2) % p or k.size(2) % p:
        raise ValueError("heads do not split")
    if q.shape == k.shape:         # one all-to-all for q, k and v
        qh, kh, vh = all_to_all(torch.stack([q, k, v], dim=3), 2, 1, group).unbind(3)
    else:
        qh, kh, vh = (all_to_all(x, 2, 1, group) for x in (q, k, v))
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qh, kh, vh)), is_causal=causal,
                                         enable_gqa=True)
    return all_to_all(out.transpose(1, 2), 1, 2, group)
''',
        why="q, k and v stacked into one all-to-all when they have the same heads (three otherwise)",
    ),
    dict(
        name="ulysses_kv_packed",
        cell="ulysses_attention",
        code='''
def ulysses_attention(q, k, v, causal=False, group=None):
    """Attention on sequence shards (b, s/P, h, d) through head shards; returns (b, s/P, h, d)."""
    _, p = group_rank_size(group)
    if q.size(2) % p or k.size(2) % p:
        raise ValueError(f"{q.size(2)} query / {k.size(2)} kv heads do not split over P = {p}")
    qh = all_to_all(q, 2, 1, group)                                       # (b, s, h/P, d)
    kh, vh = all_to_all(torch.stack([k, v], dim=3), 2, 1, group).unbind(3)   # k and v in one message, GQA too
    out = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2),
                                         is_causal=causal, enable_gqa=True)
    return all_to_all(out.transpose(1, 2), 1, 2, group)
''',
        why="k and v stacked into one all-to-all (also under GQA), q on its own: three all-to-alls each way",
    ),
    dict(
        name="ulysses_attention_with_lse_helper",
        cell="ulysses_attention",
        code='''
def ulysses_attention(q, k, v, causal=False, group=None):
    """Attention on sequence shards (b, s/P, h, d) through head shards; returns (b, s/P, h, d)."""
    _, p = group_rank_size(group)
    if q.size(2) % p or k.size(2) % p:
        raise ValueError(f"{q.size(2)} query / {k.size(2)} kv heads do not split over P = {p}")
    qh, kh, vh = (all_to_all(x, 2, 1, group) for x in (q, k, v))     # (b, s, h/P, d): the helper's layout
    out, _ = attention_with_lse(qh, kh, vh, causal)                     # (b, h/P, s, d)
    return all_to_all(out.transpose(1, 2).to(q.dtype), 1, 2, group)
''',
        why="the local attention with the handed-out attention_with_lse (activation layout in, heads first out)",
    ),
    dict(
        name="ulysses_heads_first_layout",
        cell="ulysses_attention",
        code='''
def ulysses_attention(q, k, v, causal=False, group=None):
    """Attention on sequence shards (b, s/P, h, d) through head shards; returns (b, s/P, h, d)."""
    _, p = group_rank_size(group)
    if q.size(2) % p or k.size(2) % p:
        raise ValueError(f"{q.size(2)} query / {k.size(2)} kv heads do not split over P = {p}")
    # heads first, (b, h, s/P, d): scatter dim 1 (heads), gather dim 2 (sequence)
    qh, kh, vh = (all_to_all(x.transpose(1, 2), 1, 2, group) for x in (q, k, v))     # (b, h/P, s, d)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    return all_to_all(out, 2, 1, group).transpose(1, 2)                                # (b, s/P, h, d)
''',
        why="transposes to heads-first before the all-to-alls (scatter dim 1, gather dim 2) and back after",
    ),

    # ------------------------------------------------------------------ merge_partial_attention
    dict(
        name="merge_subtracting_the_max",
        cell="merge_partial_attention",
        code='''
def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of A and B, from each one's (out, lse)."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None], m + torch.log(wa + wb)
''',
        why="the textbook merge with the max subtracted before the exps (the notebook's 'just as good')",
    ),
    dict(
        name="merge_softmax_over_the_two_sides",
        cell="merge_partial_attention",
        code='''
def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of A and B, from each one's (out, lse)."""
    both = torch.stack([lse_a, lse_b])                 # (2, ..., rows)
    w = torch.softmax(both, dim=0)[..., None]          # each side's share of the denominator
    return w[0] * out_a + w[1] * out_b, torch.logsumexp(both, dim=0)
''',
        why="the two lse's stacked: weights by softmax over the pair, lse by logsumexp over it",
    ),
    dict(
        name="merge_two_sigmoids",
        cell="merge_partial_attention",
        code='''
def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of A and B, from each one's (out, lse)."""
    diff = lse_a - lse_b
    out = torch.sigmoid(diff)[..., None] * out_a + torch.sigmoid(-diff)[..., None] * out_b
    return out, lse_a - F.logsigmoid(diff)
''',
        why="both weights as sigmoids of the difference, lse = lse_a - log σ(lse_a - lse_b) (the notebook's other form)",
    ),
    dict(
        name="merge_logaddexp",
        cell="merge_partial_attention",
        code='''
def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of A and B, from each one's (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse
''',
        why="lse by torch.logaddexp first, then weights exp(lse_x - lse): rounds lse before the weights",
    ),

    # ------------------------------------------------------------------ ring_attention_forward
    dict(
        name="ring_batched_two_messages",
        cell="ring_attention_forward",
        code='''
def ring_attention_forward(q, k, v, causal=False, group=None):
    """Ring attention on contiguous sequence shards: (out (b, s/P, h, d), lse (b, h, s/P))."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    out = lse = None
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:           # send first, in one batch: NCCL runs it as one group
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            ops = [dist.P2POp(dist.isend, t.contiguous(), global_rank(group, (rank + 1) % p), group) for t in (k, v)]
            ops += [dist.P2POp(dist.irecv, t, global_rank(group, (rank - 1) % p), group) for t in (nk, nv)]
            works = dist.batch_isend_irecv(ops)
        if not causal or src <= rank:
            ob, lb = attention_with_lse(q, k, v, causal and src == rank)
            out, lse = (ob, lb) if out is None else merge_partial_attention(out, lse, ob, lb)
        if step < p - 1:
            for w in works:
                w.wait()
            k, v = nk, nv
    return out.transpose(1, 2).to(q.dtype), lse
''',
        why="dist.batch_isend_irecv (one group: any order completes), k and v as two messages",
    ),
    dict(
        name="ring_blocking_send_recv",
        cell="ring_attention_forward",
        code='''
def ring_attention_forward(q, k, v, causal=False, group=None):
    """Synchronous send/recv, even ranks send first: no overlap, but deadlock-free."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(p):
        src = (rank - step) % p
        if not causal or src <= rank:
            ob, lb = attention_with_lse(q, kv[0], kv[1], causal and src == rank)
            out, lse = (ob, lb) if out is None else merge_partial_attention(out, lse, ob, lb)
        if step < p - 1:
            incoming = torch.empty_like(kv)
            nxt, prv = global_rank(group, (rank + 1) % p), global_rank(group, (rank - 1) % p)
            if rank % 2 == 0:
                dist.send(kv, nxt, group=group)
                dist.recv(incoming, prv, group=group)
            else:
                dist.recv(incoming, prv, group=group)
                dist.send(kv, nxt, group=group)
            kv = incoming
    return out.transpose(1, 2).to(q.dtype), lse
''',
        why="blocking dist.send/dist.recv after each block's compute, even ranks sending first: each block is "
            "computed before its pass, so no compute waits for a late peer",
    ),
    dict(
        name="ring_two_messages_parity_order",
        cell="ring_attention_forward",
        code='''
def ring_attention_forward(q, k, v, causal=False, group=None):
    """Ring attention on contiguous sequence shards: (out (b, s/P, h, d), lse (b, h, s/P))."""
    rank, p = group_rank_size(group)
    nxt, prv = global_rank(group, (rank + 1) % p), global_rank(group, (rank - 1) % p)
    out = lse = None
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            sends = lambda: [dist.isend(t.contiguous(), dst=nxt, group=group) for t in (k, v)]     # noqa: E731
            recvs = lambda: [dist.irecv(t, src=prv, group=group) for t in (nk, nv)]                # noqa: E731
            works = sends() + recvs() if rank % 2 == 0 else recvs() + sends()
        if not causal or src <= rank:
            block = attention_with_lse(q, k, v, causal=causal and src == rank)
            out, lse = block if out is None else merge_partial_attention(out, lse, *block)
        if step < p - 1:
            for w in works:
                w.wait()
            k, v = nk, nv
    return out.transpose(1, 2).to(q.dtype), lse
''',
        why="k and v as two isend/irecv pairs (no stack), even ranks posting both sends first, odd ranks both receives",
    ),

    # ------------------------------------------------------------------ zigzag_shard
    dict(
        name="zigzag_index_select",
        cell="zigzag_shard",
        replace=[("    chunks = x.chunk(2 * p, dim=1)\n    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim=1)",
                  "    c = x.size(1) // (2 * p)\n"
                  "    positions = torch.cat([torch.arange(rank * c, (rank + 1) * c, device=x.device),\n"
                  "                           torch.arange((2 * p - 1 - rank) * c, (2 * p - rank) * c, device=x.device)])\n"
                  "    return x.index_select(1, positions)")],
        why="the shard's global positions computed, then index_select along the sequence",
    ),
    dict(
        name="zigzag_narrow",
        cell="zigzag_shard",
        replace=[("    chunks = x.chunk(2 * p, dim=1)\n    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim=1)",
                  "    c = x.size(1) // (2 * p)\n"
                  "    return torch.cat([x.narrow(1, rank * c, c), x.narrow(1, (2 * p - 1 - rank) * c, c)], dim=1)")],
        why="the two chunks cut with narrow from their start positions",
    ),
    dict(
        name="zigzag_unflatten_and_pick",
        cell="zigzag_shard",
        replace=[("    chunks = x.chunk(2 * p, dim=1)\n    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim=1)",
                  "    return x.unflatten(1, (2 * p, -1))[:, [rank, 2 * p - 1 - rank]].flatten(1, 2)")],
        why="the sequence unflattened into (2P, s/2P), chunks r and 2P-1-r picked by fancy indexing, flattened back",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
