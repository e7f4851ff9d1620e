"""Lab 11 (hiding communication behind computation: exposed time, FSDP prefetch, all-gather + matmul and
matmul + reduce-scatter rings): realistic wrong implementations, and correct alternatives to the solution
that must get full marks.

Each bug edits one solution cell of solutions/lab11_overlap/lab11_overlap.ipynb and names the test
cells that must lose points; each alternative rewrites one solution cell correctly (format:
solutions/BUGBANK.md). Most bugs here compute the right numbers: what they get wrong is the schedule
(a wait before the computation it should overlap, a message posted after it, a blocking call, every
gather at once), which the tests read from the trace.
"""

EXPOSED = "test_exposed_time"
PREFETCH = "test_prefetch_forward"
AG = "test_all_gather_matmul"
RS = "test_matmul_reduce_scatter"
DEVICE = "test_overlap_device"

BUGS = [
    # ------------------------------------------------------------------ exposed_time
    dict(
        name="exposed_sums_without_union",
        cell="exposed_time",
        code='''
def exposed_time(events, rank):
    total = 0.0
    for e in events:
        if e["rank"] != rank or e["op"].startswith(("compute:", "span:", "api:")):
            continue
        if e["issued"] is None:
            total += e["end"] - e["start"]
        else:
            total += e["issued"] - e["start"]
            if e["waited"] is not None:
                total += e["end"] - e["waited"]
    return total
''',
        catches=[EXPOSED],
        why="adds every wait's length: time covered by two waits at once is counted twice",
    ),
    dict(
        name="exposed_counts_time_in_flight",
        cell="exposed_time",
        replace=[('''            waits.append((e["start"], e["issued"]))
            if e["waited"] is not None:
                waits.append((e["waited"], e["end"]))''', '''            waits.append((e["start"], e["end"]))''')],
        catches=[EXPOSED],
        why="counts an asynchronous call from issue to completion: the hidden part is called exposed",
    ),
    dict(
        name="exposed_forgets_issuing",
        cell="exposed_time",
        replace=[('''            waits.append((e["start"], e["issued"]))
''', "")],
        catches=[EXPOSED],
        why="an asynchronous call's issuing (start to issued) is left out: only the wait() counts",
    ),
    dict(
        name="exposed_counts_regions",
        cell="exposed_time",
        replace=[('''if e["rank"] != rank or e["op"].startswith(("compute:", "span:", "api:")):''',
                  '''if e["rank"] != rank:''')],
        catches=[EXPOSED],
        why="compute:, span: and api: regions are taken for blocking communication",
    ),
    dict(
        name="exposed_every_rank",
        cell="exposed_time",
        replace=[('''if e["rank"] != rank or e["op"]''', '''if e["op"]''')],
        catches=[EXPOSED],
        why="the waits of every rank in the trace are counted, not only the given rank's",
    ),
    # ------------------------------------------------------------------ prefetch_forward
    dict(
        name="prefetch_waits_at_once",
        cell="prefetch_forward",
        replace=[("""        return full, dist.all_gather_into_tensor(full, shard.contiguous(), group=group, async_op=True)""",
                  """        work = dist.all_gather_into_tensor(full, shard.contiguous(), group=group, async_op=True)
        work.wait()                                     # "to be safe"
        return full, work""")],
        catches=[PREFETCH],
        why="waits for each all-gather as soon as it is issued: the next unit's gather no longer overlaps this unit",
    ),
    dict(
        name="prefetch_after_compute",
        cell="prefetch_forward",
        code='''
def prefetch_forward(x, shards, layer, group=None):
    _, t = group_rank_size(group)

    def start_gather(shard):
        full = shard.new_empty((t * shard.shape[0], *shard.shape[1:]))
        return full, dist.all_gather_into_tensor(full, shard.contiguous(), group=group, async_op=True)

    pending = start_gather(shards[0]) if shards else None
    for i in range(len(shards)):
        weight, work = pending
        work.wait()
        x = layer(i, x, weight)
        if i + 1 < len(shards):
            pending = start_gather(shards[i + 1])      # issued once unit i is done: nothing left to hide it
    return x
''',
        catches=[PREFETCH],
        why="issues the next unit's all-gather after this unit computed: asynchronous, yet nothing overlaps",
    ),
    dict(
        name="prefetch_everything_upfront",
        cell="prefetch_forward",
        code='''
def prefetch_forward(x, shards, layer, group=None):
    _, t = group_rank_size(group)
    pending = []
    for shard in shards:                                # every unit's gather at once: all of them in memory
        full = shard.new_empty((t * shard.shape[0], *shard.shape[1:]))
        pending.append((full, dist.all_gather_into_tensor(full, shard.contiguous(), group=group, async_op=True)))
    for i, (weight, work) in enumerate(pending):
        work.wait()
        x = layer(i, x, weight)
    return x
''',
        catches=[PREFETCH],
        why="issues every unit's all-gather first: overlaps, but holds every unit's full weight at once",
    ),
    dict(
        name="prefetch_with_all_reduce",
        cell="prefetch_forward",
        code='''
def prefetch_forward(x, shards, layer, group=None):
    r, t = group_rank_size(group)

    def start_gather(shard):
        full = shard.new_zeros((t * shard.shape[0], *shard.shape[1:]))
        full[r * shard.shape[0]:(r + 1) * shard.shape[0]] = shard
        return full, dist.all_reduce(full, group=group, async_op=True)

    pending = start_gather(shards[0]) if shards else None
    for i in range(len(shards)):
        weight, work = pending
        work.wait()
        if i + 1 < len(shards):
            pending = start_gather(shards[i + 1])
        x = layer(i, x, weight)
    return x
''',
        catches=[PREFETCH],
        why="gathers by all-reducing a zero-padded full weight: right numbers, t times the bytes on the wire",
    ),
    dict(
        name="prefetch_gather_without_device",
        cell="prefetch_forward",
        replace=[("full = shard.new_empty((t * shard.shape[0], *shard.shape[1:]))",
                  "full = torch.empty((t * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype)")],
        catches=[DEVICE],
        why="the gathered weight is made without device=: right on CPU ranks, a CPU buffer for NCCL on a GPU node",
    ),
    # ------------------------------------------------------------------ all_gather_matmul
    dict(
        name="ag_waits_before_matmul",
        cell="all_gather_matmul",
        replace=[("""        out[c * n:(c + 1) * n] = mm(held, weight)
        for w in works:
            w.wait()""", """        for w in works:
            w.wait()
        out[c * n:(c + 1) * n] = mm(held, weight)""")],
        catches=[AG],
        why="waits for the step's messages before its matmul: a ring, but nothing overlaps",
    ),
    dict(
        name="ag_all_gather_then_chunks",
        cell="all_gather_matmul",
        code='''
def all_gather_matmul(x_shard, weight, mm, group=None):
    me, t = group_rank_size(group)
    n = x_shard.shape[0]
    gathered = x_shard.new_empty((t * n, x_shard.shape[1]))
    dist.all_gather_into_tensor(gathered, x_shard.contiguous(), group=group)
    out = x_shard.new_empty((t * n, weight.shape[0]))
    for c in range(t):
        out[c * n:(c + 1) * n] = mm(gathered[c * n:(c + 1) * n], weight)
    return out
''',
        catches=[AG],
        why="one blocking all-gather, then the matmul chunk by chunk: the chunks overlap nothing",
    ),
    dict(
        name="ag_wrong_slot",
        cell="all_gather_matmul",
        replace=[("c = (me - step) % t                      # whose chunk I hold now",
                  "c = (me + step) % t                      # whose chunk I hold now (wrong way round)")],
        catches=[AG],
        why="writes the chunk from the left into the slot of the rank on the right (same result for t = 2 only)",
    ),
    dict(
        name="ag_skips_last_chunk",
        cell="all_gather_matmul",
        replace=[("    for step in range(t):\n", "    for step in range(t - 1):\n")],
        catches=[AG],
        why="t - 1 steps: the last chunk arrives and is never multiplied (its rows are garbage)",
    ),
    dict(
        name="ag_blocking_send_recv",
        cell="all_gather_matmul",
        replace=[("""            works = post_exchange(held, (me + 1) % t, arriving, (me - 1) % t, group)""",
                  """            to = (me + 1) % t if group is None else dist.get_global_rank(group, (me + 1) % t)
            frm = (me - 1) % t if group is None else dist.get_global_rank(group, (me - 1) % t)
            if me % 2 == 0:
                dist.send(held, to)
                dist.recv(arriving, frm)
            else:
                dist.recv(arriving, frm)
                dist.send(held, to)""")],
        catches=[AG],
        why="blocking send/recv ordered by parity: deadlock-free, but the step's transfer is over before the matmul",
    ),
    dict(
        name="ag_output_without_device",
        cell="all_gather_matmul",
        replace=[("out = x_shard.new_empty((t * n, weight.shape[0]))",
                  "out = torch.empty((t * n, weight.shape[0]), dtype=x_shard.dtype)")],
        catches=[DEVICE],
        why="the output is made without device=: right on CPU ranks, on the CPU next to CUDA chunks on a GPU node",
    ),
    # ------------------------------------------------------------------ matmul_reduce_scatter
    dict(
        name="rs_waits_before_matmul",
        cell="matmul_reduce_scatter",
        replace=[("""        mine = mm(chunks[c], weight)
        for w in works:
            w.wait()""", """        for w in works:
            w.wait()
        mine = mm(chunks[c], weight)""")],
        catches=[RS],
        why="waits for the accumulator before computing the next contribution: nothing overlaps",
    ),
    dict(
        name="rs_matmul_then_all_reduce",
        cell="matmul_reduce_scatter",
        code='''
def matmul_reduce_scatter(x, weight, mm, group=None):
    me, t = group_rank_size(group)
    chunks = x.tensor_split(t, 0)
    partial = torch.cat([mm(chunk, weight) for chunk in chunks])
    dist.all_reduce(partial, group=group)            # the sum everywhere, then keep my chunk
    return partial.tensor_split(t, 0)[me].clone()
''',
        catches=[RS],
        why="the whole partial product, then a blocking all-reduce: right rows, twice the bytes, nothing overlapped",
    ),
    dict(
        name="rs_starts_at_own_chunk",
        cell="matmul_reduce_scatter",
        replace=[("acc = mm(chunks[(me - 1) % t], weight)", "acc = mm(chunks[me], weight)"),
                 ("c = (me - 1 - step) % t", "c = (me - step) % t")],
        catches=[RS],
        why="the accumulator of my own chunk starts here, so after t - 1 steps I hold my left neighbour's chunk",
    ),
    dict(
        name="rs_drops_own_contribution",
        cell="matmul_reduce_scatter",
        replace=[("        acc = arriving + mine\n", "        acc = arriving\n")],
        catches=[RS],
        why="passes the accumulator on without adding this rank's contribution",
    ),
    dict(
        name="rs_receive_buffer_without_device",
        cell="matmul_reduce_scatter",
        replace=[("arriving = torch.empty_like(acc)", "arriving = torch.empty(acc.shape, dtype=acc.dtype)")],
        catches=[DEVICE],
        why="the receive buffer is made without device=: right on CPU ranks, a CPU buffer for NCCL on a GPU node",
    ),
]

ALTERNATIVES = [
    # ------------------------------------------------------------------ exposed_time
    dict(
        name="exposed_merge_then_sum",
        cell="exposed_time",
        code='''
def exposed_time(events, rank):
    spans = []
    for e in events:
        if e["rank"] != rank or ":" in e["op"]:          # regions are "compute:...", "span:...", "api:..."
            continue
        if e["issued"] is None:
            spans.append([e["start"], e["end"]])
            continue
        spans.append([e["start"], e["issued"]])
        if e["waited"] is not None:
            spans.append([e["waited"], e["end"]])
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(b - a for a, b in merged)
''',
        why="merges the intervals first, then adds their lengths",
    ),
    dict(
        name="exposed_boundary_sweep",
        cell="exposed_time",
        code='''
def exposed_time(events, rank):
    edges = []
    for e in events:
        if e["rank"] != rank or e["op"].split(":")[0] in ("compute", "span", "api"):
            continue
        pieces = [(e["start"], e["end"])] if e["issued"] is None else \\
            [(e["start"], e["issued"])] + ([(e["waited"], e["end"])] if e["waited"] is not None else [])
        for a, b in pieces:
            if b > a:
                edges += [(a, 1), (b, -1)]
    total, depth, since = 0.0, 0, None
    for time, step in sorted(edges, key=lambda x: (x[0], -x[1])):
        if depth == 0 and step > 0:
            since = time
        depth += step
        if depth == 0:
            total += time - since
    return total
''',
        why="a sweep over the waits' start and end points, counting time while at least one is open",
    ),
    # ------------------------------------------------------------------ prefetch_forward
    dict(
        name="prefetch_list_all_gather",
        cell="prefetch_forward",
        code='''
def prefetch_forward(x, shards, layer, group=None):
    _, t = group_rank_size(group)

    def issue(i):
        parts = [torch.empty_like(shards[i]) for _ in range(t)]
        return parts, dist.all_gather(parts, shards[i].contiguous(), group=group, async_op=True)

    nxt = issue(0) if shards else None
    for i in range(len(shards)):
        parts, work = nxt
        work.wait()
        if i + 1 < len(shards):
            nxt = issue(i + 1)
        x = layer(i, x, torch.cat(parts))
    return x
''',
        why="list-form dist.all_gather of the shards, concatenated after the wait",
    ),
    dict(
        name="prefetch_dicts_by_unit",
        cell="prefetch_forward",
        code='''
def prefetch_forward(x, shards, layer, group=None):
    _, t = group_rank_size(group)
    weights, works = {}, {}

    def issue(i):
        if i < len(shards):
            weights[i] = shards[i].new_empty((t * shards[i].shape[0], shards[i].shape[1]))
            works[i] = dist.all_gather_into_tensor(weights[i], shards[i], group=group, async_op=True)

    issue(0)
    for i in range(len(shards)):
        works.pop(i).wait()
        issue(i + 1)
        x = layer(i, x, weights.pop(i))
    return x
''',
        why="works and weights kept in dicts by unit, each freed as soon as its unit has run",
    ),
    # ------------------------------------------------------------------ all_gather_matmul
    dict(
        name="ag_ring_to_the_left",
        cell="all_gather_matmul",
        code='''
def all_gather_matmul(x_shard, weight, mm, group=None):
    me, t = group_rank_size(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty((t * n, weight.shape[0]))
    held = x_shard.contiguous()
    for step in range(t):
        c = (me + step) % t                      # chunks come from the right this time
        works, arriving = [], None
        if step < t - 1:
            arriving = torch.empty_like(held)
            works = post_exchange(held, (me - 1) % t, arriving, (me + 1) % t, group)
        out[c * n:(c + 1) * n] = mm(held, weight)
        for w in works:
            w.wait()
        if arriving is not None:
            held = arriving
    return out
''',
        why="the ring runs the other way: send left, receive from the right",
    ),
    dict(
        name="ag_own_isend_irecv_and_cat",
        cell="all_gather_matmul",
        code='''
def all_gather_matmul(x_shard, weight, mm, group=None):
    me, t = group_rank_size(group)
    right = dist.get_global_rank(group, (me + 1) % t) if group is not None else (me + 1) % t
    left = dist.get_global_rank(group, (me - 1) % t) if group is not None else (me - 1) % t
    pieces = [None] * t
    held = x_shard.contiguous()
    for step in range(t):
        pending = []
        if step < t - 1:
            arriving = torch.empty_like(held)
            ops = [dist.P2POp(dist.irecv, arriving, left, group), dist.P2POp(dist.isend, held, right, group)]
            pending = dist.batch_isend_irecv(ops)
        pieces[(me - step) % t] = mm(held, weight)
        for work in pending:
            work.wait()
        if step < t - 1:
            held = arriving
    return torch.cat(pieces)
''',
        why="its own batched isend/irecv (receive listed first), and the output concatenated at the end",
    ),
    # ------------------------------------------------------------------ matmul_reduce_scatter
    dict(
        name="rs_ring_to_the_left",
        cell="matmul_reduce_scatter",
        code='''
def matmul_reduce_scatter(x, weight, mm, group=None):
    me, t = group_rank_size(group)
    chunks = x.tensor_split(t, 0)
    acc = mm(chunks[(me + 1) % t], weight)
    for step in range(1, t):
        c = (me + 1 + step) % t
        arriving = torch.empty_like(acc)
        works = post_exchange(acc, (me - 1) % t, arriving, (me + 1) % t, group)
        mine = mm(chunks[c], weight)
        for w in works:
            w.wait()
        acc = arriving + mine
    return acc
''',
        why="the accumulators travel left: chunk c's starts at rank c - 1",
    ),
    dict(
        name="rs_add_in_place",
        cell="matmul_reduce_scatter",
        code='''
def matmul_reduce_scatter(x, weight, mm, group=None):
    me, t = group_rank_size(group)
    n = x.shape[0] // t
    acc = mm(x[((me - 1) % t) * n:((me - 1) % t + 1) * n], weight)
    arriving = torch.empty_like(acc)
    for step in range(1, t):
        c = (me - 1 - step) % t
        works = post_exchange(acc, (me + 1) % t, arriving, (me - 1) % t, group)
        mine = mm(x[c * n:(c + 1) * n], weight)
        for w in works:
            w.wait()
        acc, arriving = arriving, acc                   # the sent buffer becomes the next receive buffer
        acc += mine
    return acc
''',
        why="two buffers swapped each step, the contribution added in place after the wait",
    ),
]
