"""Lab 1 (collectives from send/recv): realistic wrong implementations.

Each bug replaces one solution cell of solutions/lab1_collectives/lab1_collectives.ipynb
and names the test cells that must lose points (format: solutions/BUGBANK.md).

A note on the pattern tests: they run the same correctness check first, so a bug that
gives a wrong result also fails the pattern test of its function. Bugs that compute the
right sum in the wrong way (whole tensors, wrong partners) fail *only* the pattern test;
that is what the pattern tests are for.
"""

BUGS = [
    # ------------------------------------------------------------------ sendrecv (helper)
    # Not graded by itself, but every ring and butterfly is built on it: its bugs must show
    # up in the tests of the functions that use it.
    dict(
        name="sendrecv_blocking_send_first",
        cell="sendrecv",
        code='''
def sendrecv(send_tensor, dst, recv_tensor, src):
    """Send `send_tensor` to rank `dst` while receiving into `recv_tensor` from rank `src`."""
    dist.send(send_tensor, dst=dst)
    dist.recv(recv_tensor, src=src)
''',
        catches=["test_ring_reduce_scatter_correct", "test_ring_reduce_scatter_pattern",
                 "test_ring_all_reduce_correct", "test_ring_all_reduce_pattern",
                 "test_recursive_halving_all_reduce_correct", "test_recursive_halving_all_reduce_pattern"],
        why="everyone-sends-first deadlock: blocking send before recv, on every rank at once",
    ),
    dict(
        name="sendrecv_blocking_recv_first",
        cell="sendrecv",
        code='''
def sendrecv(send_tensor, dst, recv_tensor, src):
    """Send `send_tensor` to rank `dst` while receiving into `recv_tensor` from rank `src`."""
    dist.recv(recv_tensor, src=src)
    dist.send(send_tensor, dst=dst)
''',
        catches=["test_ring_reduce_scatter_correct", "test_ring_reduce_scatter_pattern",
                 "test_ring_all_reduce_correct", "test_ring_all_reduce_pattern",
                 "test_recursive_halving_all_reduce_correct", "test_recursive_halving_all_reduce_pattern"],
        why="everyone-receives-first deadlock: nobody ever sends",
    ),
    dict(
        name="sendrecv_swapped_peers",
        cell="sendrecv",
        replace=[("dist.isend(send_tensor, dst=dst)", "dist.isend(send_tensor, dst=src)"),
                 ("dist.irecv(recv_tensor, src=src)", "dist.irecv(recv_tensor, src=dst)")],
        catches=["test_ring_reduce_scatter_correct", "test_ring_reduce_scatter_pattern",
                 "test_ring_all_reduce_correct", "test_ring_all_reduce_pattern"],
        why="dst and src swapped: the ring turns the other way, so the chunk schedule is wrong "
            "(a pairwise swap, as in halving, does not notice)",
    ),
    dict(
        name="sendrecv_waits_for_the_send_only",
        cell="sendrecv",
        replace=[("    send_request.wait()\n    recv_request.wait()",
                  "    send_request.wait()                # my neighbour has my data, so I must have theirs")],
        catches=["test_ring_reduce_scatter_correct"],
        why="waits for the send only, as if a symmetric exchange finished both ways at once: the receive may not "
            "have landed when its data is used (the check names the unwaited irecv and its line)",
    ),

    # ------------------------------------------------------------------ broadcast
    dict(
        name="broadcast_recv_from_rank0",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    if rank == src:
        requests = [dist.isend(out, dst=peer) for peer in range(world) if peer != src]
        for request in requests:
            request.wait()
    else:
        dist.recv(out, src=0)
    return out
''',
        catches=["test_broadcast_correct"],
        why="receivers wait for rank 0 instead of the root src (only works for src=0)",
    ),
    dict(
        name="broadcast_receives_into_input",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == src:
        for peer in range(world):
            if peer != src:
                dist.send(tensor, dst=peer)
        return tensor.clone()
    dist.recv(tensor, src=src)
    return tensor
''',
        catches=["test_broadcast_correct"],
        why="receives straight into the caller's tensor: the input is overwritten",
    ),
    dict(
        name="broadcast_calls_dist_broadcast",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    out = tensor.clone()
    dist.broadcast(out, src=src)
    return out
''',
        catches=["test_broadcast_correct", "test_naive_all_reduce_correct", "test_naive_all_reduce_pattern"],
        why="shortcut: torch.distributed's own broadcast (naive_all_reduce, built on it, fails too)",
    ),
    dict(
        name="broadcast_only_to_next_rank",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    if world == 1:
        return out
    if rank == src:
        dist.send(out, dst=(src + 1) % world)
    else:
        dist.recv(out, src=src)
    return out
''',
        catches=["test_broadcast_correct", "test_naive_all_reduce_correct", "test_naive_all_reduce_pattern"],
        why="the root sends once, to its neighbour; every other rank waits forever "
            "(naive_all_reduce, built on it, fails too)",
    ),

    # ------------------------------------------------------------------ naive all-reduce
    dict(
        name="naive_recv_overwrites_sum",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    if rank == 0:
        for peer in range(1, world):
            dist.recv(total, src=peer)
    else:
        dist.send(total, dst=0)
    return broadcast(total, src=0)
''',
        catches=["test_naive_all_reduce_correct", "test_naive_all_reduce_pattern"],
        why="rank 0 receives on top of its running sum instead of adding: the last rank wins",
    ),
    dict(
        name="naive_forgets_broadcast",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    if rank == 0:
        incoming = torch.empty_like(total)
        for peer in range(1, world):
            dist.recv(incoming, src=peer)
            total += incoming
    else:
        dist.send(total, dst=0)
    return total
''',
        catches=["test_naive_all_reduce_correct", "test_naive_all_reduce_pattern"],
        why="a reduce, not an all-reduce: only rank 0 gets the sum",
    ),
    dict(
        name="naive_everyone_to_everyone",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = [tensor.clone() if peer == rank else torch.empty_like(tensor) for peer in range(world)]
    requests = []
    for peer in range(world):
        if peer != rank:
            requests.append(dist.isend(tensor, dst=peer))
            requests.append(dist.irecv(pieces[peer], src=peer))
    for request in requests:
        request.wait()
    total = pieces[0].clone()
    for piece in pieces[1:]:
        total += piece
    return total
''',
        catches=["test_naive_all_reduce_pattern"],
        why="right sum, wrong algorithm: everyone sends to everyone instead of through rank 0",
    ),
    dict(
        name="naive_calls_dist_reduce",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    total = tensor.clone()
    dist.reduce(total, dst=0)
    return broadcast(total, src=0)
''',
        catches=["test_naive_all_reduce_correct", "test_naive_all_reduce_pattern"],
        why="shortcut: torch.distributed's reduce for the first phase",
    ),
    dict(
        name="naive_recv_from_any_source",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        received = {}
        for _ in range(1, world):
            incoming = torch.empty_like(tensor)
            received[dist.recv(incoming)] = incoming       # from whichever rank is ready first
        total = tensor.clone()
        for peer in sorted(received):                      # a fixed order: the same sum every run
            total += received[peer]
    else:
        dist.send(tensor, dst=0)
        total = torch.empty_like(tensor)
    return broadcast(total, 0)
''',
        catches=["test_naive_all_reduce_correct"],
        why="rank 0 receives from any source (recv without src): right under gloo, but NCCL has no receive "
            "from any source, so it cannot run on GPUs; the tests fail it and say so",
    ),

    # ------------------------------------------------------------------ ring reduce-scatter
    dict(
        name="rs_off_by_one_chunk",
        cell="ring_reduce_scatter",
        replace=[("send_index = (rank - step - 1) % world", "send_index = (rank - step) % world"),
                 ("recv_index = (rank - step - 2) % world", "recv_index = (rank - step - 1) % world")],
        catches=["test_ring_reduce_scatter_correct", "test_ring_reduce_scatter_pattern"],
        why="off-by-one chunk index: the chunk that ends complete on rank r is r+1, not r",
    ),
    dict(
        name="rs_whole_tensor_each_step",
        cell="ring_reduce_scatter",
        code='''
def ring_reduce_scatter(tensor):
    """Return, on rank r, the sum over all ranks of chunk r of `tensor.tensor_split(N)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    total = tensor.clone()
    passing = tensor.clone()
    for step in range(world - 1):
        incoming = torch.empty_like(passing)
        sendrecv(passing, right, incoming, left)
        total += incoming
        passing = incoming
    return total.tensor_split(world)[rank].clone()
''',
        catches=["test_ring_reduce_scatter_pattern"],
        why="sends the whole tensor at every step (passes every rank's tensor around the ring): "
            "right answer, N times the traffic",
    ),
    dict(
        name="rs_everyone_sends_first",
        cell="ring_reduce_scatter",
        code='''
def ring_reduce_scatter(tensor):
    """Return, on rank r, the sum over all ranks of chunk r of `tensor.tensor_split(N)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.clone().tensor_split(world)
    for step in range(world - 1):
        send_index = (rank - step - 1) % world
        recv_index = (rank - step - 2) % world
        incoming = torch.empty_like(chunks[recv_index])
        dist.send(chunks[send_index], dst=right)
        dist.recv(incoming, src=left)
        chunks[recv_index].add_(incoming)
    return chunks[rank].clone()
''',
        catches=["test_ring_reduce_scatter_correct", "test_ring_reduce_scatter_pattern"],
        why="everyone-sends-first deadlock: blocking send then recv instead of sendrecv",
    ),
    dict(
        name="rs_overwrites_instead_of_adding",
        cell="ring_reduce_scatter",
        code='''
def ring_reduce_scatter(tensor):
    """Return, on rank r, the sum over all ranks of chunk r of `tensor.tensor_split(N)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.clone().tensor_split(world)
    for step in range(world - 1):
        send_index = (rank - step - 1) % world
        recv_index = (rank - step - 2) % world
        sendrecv(chunks[send_index], right, chunks[recv_index], left)
    return chunks[rank].clone()
''',
        catches=["test_ring_reduce_scatter_correct", "test_ring_reduce_scatter_pattern"],
        why="receives into the chunk instead of adding to it (an all-gather step, not a reduce step)",
    ),

    # ------------------------------------------------------------------ ring all-reduce
    dict(
        name="ring_off_by_one_allgather",
        cell="ring_all_reduce",
        replace=[("send_index = (rank - step) % world", "send_index = (rank - step - 1) % world"),
                 ("recv_index = (rank - step - 1) % world\n        sendrecv(chunks[send_index], right, chunks[recv_index], left)",
                  "recv_index = (rank - step - 2) % world\n        sendrecv(chunks[send_index], right, chunks[recv_index], left)")],
        catches=["test_ring_all_reduce_correct", "test_ring_all_reduce_pattern"],
        why="off-by-one chunk index in the all-gather (copied from the reduce-scatter): "
            "unfinished chunks are passed around",
    ),
    dict(
        name="ring_missing_allgather",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = tensor.flatten().clone()
    chunks = out.tensor_split(world)
    for step in range(world - 1):
        send_index = (rank - step - 1) % world
        recv_index = (rank - step - 2) % world
        incoming = torch.empty_like(chunks[recv_index])
        sendrecv(chunks[send_index], right, incoming, left)
        chunks[recv_index].add_(incoming)
    return out.view(tensor.shape)
''',
        catches=["test_ring_all_reduce_correct", "test_ring_all_reduce_pattern"],
        why="missing all-gather phase: each rank only has its own chunk fully summed",
    ),
    dict(
        name="ring_whole_tensor_each_step",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    contributions = [None] * world
    contributions[rank] = tensor.clone()
    passing = contributions[rank]
    for step in range(world - 1):
        incoming = torch.empty_like(passing)
        sendrecv(passing, right, incoming, left)
        contributions[(rank - step - 1) % world] = incoming
        passing = incoming
    total = contributions[0].clone()
    for part in contributions[1:]:
        total += part
    return total
''',
        catches=["test_ring_all_reduce_pattern"],
        why="sends the whole tensor at every step (passes every rank's tensor around, then sums "
            "in rank order): right answer, (N-1)·S bytes per rank instead of 2(N-1)/N·S",
    ),
    dict(
        name="ring_everyone_sends_first",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = tensor.flatten().clone()
    chunks = out.tensor_split(world)
    for step in range(world - 1):
        send_index = (rank - step - 1) % world
        recv_index = (rank - step - 2) % world
        incoming = torch.empty_like(chunks[recv_index])
        dist.send(chunks[send_index], dst=right)
        dist.recv(incoming, src=left)
        chunks[recv_index].add_(incoming)
    for step in range(world - 1):
        send_index = (rank - step) % world
        recv_index = (rank - step - 1) % world
        dist.send(chunks[send_index], dst=right)
        dist.recv(chunks[recv_index], src=left)
    return out.view(tensor.shape)
''',
        catches=["test_ring_all_reduce_correct", "test_ring_all_reduce_pattern"],
        why="everyone-sends-first deadlock: blocking send then recv on every rank",
    ),
    dict(
        name="ring_calls_dist_all_reduce",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out
''',
        catches=["test_ring_all_reduce_correct", "test_ring_all_reduce_pattern"],
        why="shortcut: torch.distributed's all_reduce",
    ),
    dict(
        name="ring_calls_minidist_ring",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    from minidist.collectives import ring_all_reduce as library_ring
    return library_ring(tensor)
''',
        catches=["test_ring_all_reduce_correct", "test_ring_all_reduce_pattern"],
        why="shortcut: minidist's own ring implementation",
    ),
    dict(
        name="ring_buffer_without_device",
        cell="ring_all_reduce",
        replace=[("incoming = torch.empty_like(chunks[recv_index])",
                  "incoming = torch.zeros(len(chunks[recv_index]), dtype=tensor.dtype)")],
        catches=["test_collectives_device"],
        why="the receive buffer is made without device=: right on a laptop's CPU ranks, on the CPU "
            "next to the GPU's chunks on a GPU node (only the device check sees it)",
    ),

    # ------------------------------------------------------------------ recursive halving
    dict(
        name="halving_partner_plus_distance",
        cell="recursive_halving_all_reduce",
        replace=[("partner = rank ^ distance", "partner = (rank + distance) % world")],
        catches=["test_recursive_halving_all_reduce_correct", "test_recursive_halving_all_reduce_pattern"],
        why="partner rank + d instead of rank XOR d: pairs do not match up (r's partner is not "
            "partner's partner)",
    ),
    dict(
        name="halving_no_power_of_two_check",
        cell="recursive_halving_all_reduce",
        replace=[('    if world & (world - 1):\n'
                  '        raise ValueError(f"recursive halving needs a power-of-two world size, got {world}")\n', '')],
        catches=["test_recursive_halving_all_reduce_correct"],
        why="no ValueError for a world size that is not a power of two (the lab's contract): on N = 3 the "
            "pairing sends to a rank that does not exist or waits forever",
    ),
    dict(
        name="halving_allgather_same_order",
        cell="recursive_halving_all_reduce",
        replace=[("for partner, keep, give in reversed(rounds):", "for partner, keep, give in rounds:")],
        catches=["test_recursive_halving_all_reduce_correct", "test_recursive_halving_all_reduce_pattern"],
        why="the all-gather replays the rounds in the same order instead of reversed: "
            "half-finished ranges are swapped first",
    ),
    dict(
        name="halving_both_keep_lower_half",
        cell="recursive_halving_all_reduce",
        replace=[("keep, give = ((lo, mid), (mid, hi)) if rank < partner else ((mid, hi), (lo, mid))",
                  "keep, give = (lo, mid), (mid, hi)")],
        catches=["test_recursive_halving_all_reduce_correct", "test_recursive_halving_all_reduce_pattern"],
        why="both partners keep the lower half: the upper half is never reduced",
    ),
    dict(
        name="halving_whole_tensor_each_round",
        cell="recursive_halving_all_reduce",
        code='''
def recursive_halving_all_reduce(tensor):
    """Return the sum over all ranks of `tensor` (N a power of two): recursive-halving
    reduce-scatter, then recursive-doubling all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world & (world - 1):
        raise ValueError(f"recursive halving needs a power-of-two world size, got {world}")
    total = tensor.clone()
    distance = 1
    while distance < world:
        partner = rank ^ distance
        incoming = torch.empty_like(total)
        sendrecv(total, partner, incoming, partner)
        total = total + incoming if rank < partner else incoming + total
        distance *= 2
    return total
''',
        catches=["test_recursive_halving_all_reduce_pattern"],
        why="recursive doubling of the whole tensor: right answer in lg N rounds, but every "
            "round sends all S bytes instead of halving",
    ),
    dict(
        name="halving_uses_own_ring",
        cell="recursive_halving_all_reduce",
        code='''
def recursive_halving_all_reduce(tensor):
    """Return the sum over all ranks of `tensor` (N a power of two): recursive-halving
    reduce-scatter, then recursive-doubling all-gather."""
    return ring_all_reduce(tensor)
''',
        catches=["test_recursive_halving_all_reduce_pattern"],
        why="reuses the ring: right answer, but 2(N-1) neighbour messages instead of 2 lg N "
            "rounds at distances 1, 2, 4, ...",
    ),
    dict(
        name="halving_calls_dist_all_reduce",
        cell="recursive_halving_all_reduce",
        code='''
def recursive_halving_all_reduce(tensor):
    """Return the sum over all ranks of `tensor` (N a power of two): recursive-halving
    reduce-scatter, then recursive-doubling all-gather."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out
''',
        catches=["test_recursive_halving_all_reduce_correct", "test_recursive_halving_all_reduce_pattern"],
        why="shortcut: torch.distributed's all_reduce",
    ),
]


# Correct implementations other than the solution's: each must get full marks (format:
# solutions/BUGBANK.md). Without `tests`, an alternative must pass every test that a
# bug of its cell must fail (for sendrecv: every ring and halving test; for broadcast: its own
# test and both naive all-reduce tests, since naive_all_reduce broadcasts with it).
ALTERNATIVES = [
    # ------------------------------------------------------------------ sendrecv (helper)
    dict(
        name="sendrecv_isend_then_blocking_recv",
        cell="sendrecv",
        code='''
def sendrecv(send_tensor, dst, recv_tensor, src):
    """Send `send_tensor` to rank `dst` while receiving into `recv_tensor` from rank `src`."""
    request = dist.isend(send_tensor, dst=dst)
    dist.recv(recv_tensor, src=src)
    request.wait()
''',
        why="only the send is non-blocking: posts it, then a blocking recv, then waits for the send",
    ),
    dict(
        name="sendrecv_irecv_then_blocking_send",
        cell="sendrecv",
        code='''
def sendrecv(send_tensor, dst, recv_tensor, src):
    """Send `send_tensor` to rank `dst` while receiving into `recv_tensor` from rank `src`."""
    request = dist.irecv(recv_tensor, src=src)
    dist.send(send_tensor, dst=dst)
    request.wait()
''',
        why="posts the receive first, then a blocking send (its partner's receive is already posted)",
    ),
    dict(
        name="sendrecv_pairwise_ordered_by_rank",
        cell="sendrecv",
        code='''
def sendrecv(send_tensor, dst, recv_tensor, src):
    """Send `send_tensor` to rank `dst` while receiving into `recv_tensor` from rank `src`."""
    if dst == src:
        # A swap with one partner (question 5): the lower rank sends first, the higher
        # receives first, so blocking calls cannot wait on each other.
        if dist.get_rank() < dst:
            dist.send(send_tensor, dst=dst)
            dist.recv(recv_tensor, src=src)
        else:
            dist.recv(recv_tensor, src=src)
            dist.send(send_tensor, dst=dst)
        return
    requests = [dist.irecv(recv_tensor, src=src), dist.isend(send_tensor, dst=dst)]
    for request in requests:
        request.wait()
''',
        why="the lab's question 5: a swap with one partner uses blocking calls ordered by rank; "
            "distinct peers (a ring) post irecv then isend and wait for both",
    ),

    # ------------------------------------------------------------------ broadcast
    dict(
        name="broadcast_binomial_tree",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    relative = (rank - src) % world          # the root is 0 in the tree
    mask = 1
    while mask < world:                      # receive once, from the parent
        if relative & mask:
            dist.recv(out, src=(rank - mask) % world)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:                          # then forward to the children, farthest first
        if relative + mask < world:
            dist.send(out, dst=(rank + mask) % world)
        mask >>= 1
    return out
''',
        why="the lab's going-further binomial tree (ceil(lg N) rounds, ranks relative to the root); "
            "naive_all_reduce's broadcast phase then runs as a tree too",
    ),
    dict(
        name="broadcast_binomial_doubling_rounds",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    relative = (rank - src) % world
    distance = 1
    while distance < world:
        # Round k: the 2^k ranks that have the data send to the ones 2^k further on.
        if relative < distance and relative + distance < world:
            dist.isend(out, dst=(rank + distance) % world).wait()
        elif distance <= relative < 2 * distance:
            dist.irecv(out, src=(rank - distance) % world).wait()
        distance *= 2
    return out
''',
        why="binomial tree written round by round (distance 1, 2, 4, ...: the informed ranks double), "
            "with isend/irecv",
    ),
    dict(
        name="broadcast_root_blocking_sends",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    out = tensor.clone()
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(out, dst=peer)
    else:
        dist.recv(out, src=src)
    return out
''',
        why="the root sends with blocking sends, one peer after the other, instead of isends",
    ),
    dict(
        name="broadcast_chain",
        cell="broadcast",
        code='''
def broadcast(tensor, src):
    """Return, on every rank, a copy of `tensor` as it is on rank `src`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    if rank != src:
        dist.recv(out, src=(rank - 1) % world)
    if (rank + 1) % world != src:
        dist.send(out, dst=(rank + 1) % world)
    return out
''',
        why="a chain: the root sends to its right neighbour, which forwards it, and so on around the ring",
    ),

    # ------------------------------------------------------------------ naive all-reduce
    dict(
        name="naive_irecv_all_then_sum",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        buffers = [torch.empty_like(tensor) for _ in range(1, world)]
        requests = [dist.irecv(buf, src=peer) for peer, buf in zip(range(1, world), buffers)]
        for request in requests:
            request.wait()
        total = torch.stack([tensor, *buffers]).sum(0)
    else:
        dist.isend(tensor, dst=0).wait()
        total = torch.empty_like(tensor)
    return broadcast(total, src=0)
''',
        why="rank 0 posts every receive at once into its own buffer and sums them with one torch.stack(...).sum",
    ),
    dict(
        name="naive_inline_broadcast",
        cell="naive_all_reduce",
        code='''
def naive_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: reduce to rank 0, then broadcast from it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        total = tensor.clone()
        for peer in range(1, world):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, src=peer)
            total = total + incoming
        for peer in range(1, world):
            dist.send(total, dst=peer)
        return total
    dist.send(tensor, dst=0)
    total = torch.empty_like(tensor)
    dist.recv(total, src=0)
    return total
''',
        why="writes both phases out with blocking send/recv (out-of-place sum) instead of calling broadcast",
    ),

    # ------------------------------------------------------------------ ring reduce-scatter
    dict(
        name="rs_ring_turning_left",
        cell="ring_reduce_scatter",
        code='''
def ring_reduce_scatter(tensor):
    """Return, on rank r, the sum over all ranks of chunk r of `tensor.tensor_split(N)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.clone().tensor_split(world)
    for step in range(world - 1):
        # Partial sums travel to the left: chunk c starts at rank c + 1 and ends at rank c.
        send_index = (rank + step + 1) % world
        recv_index = (rank + step + 2) % world
        incoming = torch.empty_like(chunks[recv_index])
        sendrecv(chunks[send_index], left, incoming, right)
        chunks[recv_index].add_(incoming)
    return chunks[rank].clone()
''',
        why="the ring runs the other way (send left, receive from the right) with the chunk schedule mirrored",
    ),
    dict(
        name="rs_list_out_of_place_isend_irecv",
        cell="ring_reduce_scatter",
        code='''
def ring_reduce_scatter(tensor):
    """Return, on rank r, the sum over all ranks of chunk r of `tensor.tensor_split(N)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    partial = list(tensor.tensor_split(world))      # views of the input, never written to
    for step in range(world - 1):
        send_index = (rank - step - 1) % world
        recv_index = (rank - step - 2) % world
        incoming = torch.empty_like(partial[recv_index])
        requests = [dist.irecv(incoming, src=(rank - 1) % world),
                    dist.isend(partial[send_index], dst=(rank + 1) % world)]
        for request in requests:
            request.wait()
        partial[recv_index] = partial[recv_index] + incoming
    return partial[rank].clone()
''',
        why="no clone of the input: a list of chunks, each replaced by an out-of-place sum; "
            "posts irecv/isend itself",
    ),

    # ------------------------------------------------------------------ ring all-reduce
    dict(
        name="ring_turning_left",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = tensor.flatten().clone()
    chunks = out.tensor_split(world)
    for step in range(world - 1):
        send_index = (rank + step + 1) % world
        recv_index = (rank + step + 2) % world
        incoming = torch.empty_like(chunks[recv_index])
        sendrecv(chunks[send_index], left, incoming, right)
        chunks[recv_index].add_(incoming)
    for step in range(world - 1):
        sendrecv(chunks[(rank + step) % world], left, chunks[(rank + step + 1) % world], right)
    return out.view(tensor.shape)
''',
        why="both phases run the ring the other way (send left), with the chunk schedule mirrored",
    ),
    dict(
        name="ring_reuses_own_reduce_scatter",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.flatten()
    mine = ring_reduce_scatter(flat)
    out = torch.empty_like(flat)
    chunks = out.tensor_split(world)
    chunks[rank].copy_(mine)
    for step in range(world - 1):
        sendrecv(chunks[(rank - step) % world], (rank + 1) % world,
                 chunks[(rank - step - 1) % world], (rank - 1) % world)
    return out.view(tensor.shape)
''',
        why="calls the student's own ring_reduce_scatter, then runs only the all-gather into a fresh buffer",
    ),
    dict(
        name="ring_list_chunks_and_cat",
        cell="ring_all_reduce",
        code='''
def ring_all_reduce(tensor):
    """Return the sum over all ranks of `tensor`: ring reduce-scatter, then ring all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = [c.clone() for c in tensor.reshape(-1).tensor_split(world)]
    for step in range(world - 1):
        send_index, recv_index = (rank - step - 1) % world, (rank - step - 2) % world
        incoming = torch.empty_like(chunks[recv_index])
        sendrecv(chunks[send_index], right, incoming, left)
        chunks[recv_index] = chunks[recv_index] + incoming
    for step in range(world - 1):
        send_index, recv_index = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_index])
        sendrecv(chunks[send_index], right, incoming, left)
        chunks[recv_index] = incoming
    return torch.cat(chunks).reshape(tensor.shape)
''',
        why="a list of separate chunk tensors (out-of-place add, fresh receive buffers) joined with torch.cat",
    ),

    # ------------------------------------------------------------------ recursive halving
    dict(
        name="halving_distance_descending",
        cell="recursive_halving_all_reduce",
        replace=[("    distance = 1\n    while distance < world:", "    distance = world // 2\n    while distance >= 1:"),
                 ("        distance *= 2", "        distance //= 2")],
        why="partner distances N/2, N/4, ..., 1 in the reduce-scatter (the doubling all-gather replays them backwards)",
    ),
    dict(
        name="halving_element_ranges_recursive",
        cell="recursive_halving_all_reduce",
        code='''
def recursive_halving_all_reduce(tensor):
    """Return the sum over all ranks of `tensor` (N a power of two): recursive-halving
    reduce-scatter, then recursive-doubling all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world & (world - 1):
        raise ValueError(f"recursive halving needs a power-of-two world size, got {world}")
    out = tensor.flatten().clone()

    def halve_then_double(lo, hi, distance):
        """Reduce out[lo:hi] with the ranks at XOR-distances >= distance, then gather it back."""
        if distance >= world:
            return
        partner = rank ^ distance
        mid = (lo + hi) // 2                          # element offsets, not chunk indices
        keep, give = ((lo, mid), (mid, hi)) if rank < partner else ((mid, hi), (lo, mid))
        incoming = torch.empty_like(out[keep[0]:keep[1]])
        sendrecv(out[give[0]:give[1]], partner, incoming, partner)
        out[keep[0]:keep[1]] += incoming
        halve_then_double(*keep, distance * 2)
        sendrecv(out[keep[0]:keep[1]], partner, out[give[0]:give[1]], partner)

    halve_then_double(0, out.numel(), 1)
    return out.view(tensor.shape)
''',
        why="recursion instead of a list of rounds (the all-gather step runs as the call returns), "
            "halving element ranges rather than ranges of tensor_split chunks",
    ),
    dict(
        name="halving_upper_rank_keeps_lower_half",
        cell="recursive_halving_all_reduce",
        replace=[("keep, give = ((lo, mid), (mid, hi)) if rank < partner else ((mid, hi), (lo, mid))",
                  "keep, give = ((lo, mid), (mid, hi)) if rank > partner else ((mid, hi), (lo, mid))")],
        why="the other half assignment: the higher rank of each pair keeps the lower half",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
