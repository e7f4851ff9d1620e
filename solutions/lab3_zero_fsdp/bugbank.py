"""Lab 3 (ZeRO-1/2/3, FSDP): realistic wrong implementations.

Each bug replaces one solution cell of solutions/lab3_zero_fsdp/lab3_zero_fsdp.ipynb and
names the test cells that must lose points (format: solutions/BUGBANK.md).

Each stage's end-to-end tests grade only the functions that stage adds (the lab's reference
stands in for the others: minidist.checks.lab3_zero_fsdp.cases.GRADED), so a bug in
reduce_scatter_gradients is caught by its own test and ZeRO-2's, one in sharded_step by
ZeRO-1's, one in gather/free by ZeRO-3's. Three kinds of tests catch them: equality with single-process training (Adam, and SGD with
momentum for a wrong gradient scale), the traced collectives and their bytes, and the
measured bytes per rank (live storages, minidist.memory) against the ZeRO formula.
"""

BUGS = [
    # ------------------------------------------------------------------ reduce_scatter_gradients
    dict(
        name="rs_forgets_to_average",
        cell="reduce_scatter_gradients",
        replace=[("    mine.div_(dist.get_world_size())\n", "")],
        catches=["test_reduce_scatter_gradients", "test_zero2"],
        why="each rank keeps the SUM of its gradient shard: the SGD step is N times too large",
    ),
    dict(
        name="rs_averages_twice",
        cell="reduce_scatter_gradients",
        replace=[("    dist.reduce_scatter_tensor(mine, flat_grad)\n",
                  "    flat_grad.div_(dist.get_world_size())\n    dist.reduce_scatter_tensor(mine, flat_grad)\n")],
        catches=["test_reduce_scatter_gradients", "test_zero2"],
        why="divides by N before the reduce-scatter and again after",
    ),
    dict(
        name="rs_keeps_full_gradients",
        cell="reduce_scatter_gradients",
        replace=[("    for p in unit.params:\n        p.grad = None", "")],
        catches=["test_reduce_scatter_gradients", "test_zero2"],
        why="the full gradients stay alive after the reduce-scatter: ZeRO-2 saves no gradient memory",
    ),
    dict(
        name="rs_overwrites_shard_grad",
        cell="reduce_scatter_gradients",
        replace=[("    if unit.shard.grad is None:\n        unit.shard.grad = mine\n    else:\n        unit.shard.grad += mine\n",
                  "    unit.shard.grad = mine\n")],
        catches=["test_reduce_scatter_gradients"],
        why="replaces the shard's gradient instead of adding to it: gradient accumulation loses micro-batches",
    ),
    dict(
        name="rs_all_reduce_then_slice",
        cell="reduce_scatter_gradients",
        code='''
def reduce_scatter_gradients(unit):
    """unit.shard.grad += average over ranks of this rank's shard of the unit's flat gradient."""
    flat_grad = unit.layout.flatten([p.grad for p in unit.params], like=unit.shard)
    dist.all_reduce(flat_grad)
    mine = unit.layout.my_shard(flat_grad) / dist.get_world_size()
    if unit.shard.grad is None:
        unit.shard.grad = mine
    else:
        unit.shard.grad += mine
    for p in unit.params:
        p.grad = None
''',
        catches=["test_reduce_scatter_gradients", "test_zero2"],
        why="all-reduces the whole gradient and keeps a slice: right numbers, twice the traffic of a reduce-scatter",
    ),
    dict(
        name="rs_packs_present_gradients_only",
        cell="reduce_scatter_gradients",
        replace=[("    flat_grad = unit.layout.flatten([p.grad for p in unit.params], like=unit.shard)\n",
                  "    grads = [p.grad.reshape(-1) for p in unit.params if p.grad is not None]\n"
                  "    flat_grad = torch.cat(grads) if grads else unit.shard.new_zeros(0)\n"
                  "    flat_grad = torch.cat([flat_grad, flat_grad.new_zeros(unit.layout.padded_numel - flat_grad.numel())])\n")],
        catches=["test_reduce_scatter_gradients"],
        why="packs the gradients that exist and pads at the end: right when the missing gradient is the last "
            "one, but one missing in the middle shifts every later gradient into the wrong place",
    ),
    dict(
        name="rs_output_is_the_shard",
        cell="reduce_scatter_gradients",
        replace=[("    mine = torch.empty_like(unit.shard)\n",
                  "    mine = unit.shard.detach()        # reuse the shard's memory: no allocation\n")],
        catches=["test_reduce_scatter_gradients"],
        why="reduce-scatters into the shard itself: the parameters are overwritten by the gradient, and the "
            "second micro-batch's result replaces the first (passes when both micro-batches are equal)",
    ),
    dict(
        name="rs_async_adds_before_the_result_arrives",
        cell="reduce_scatter_gradients",
        replace=[("    dist.reduce_scatter_tensor(mine, flat_grad)\n    mine.div_(dist.get_world_size())\n",
                  "    work = dist.reduce_scatter_tensor(mine, flat_grad, async_op=True)   # overlap with the bookkeeping\n"
                  "    mine.div_(dist.get_world_size())\n"),
                 ("    for p in unit.params:\n        p.grad = None", "    for p in unit.params:\n        p.grad = None\n    work.wait()")],
        catches=["test_reduce_scatter_gradients"],
        why="an async reduce-scatter whose output is divided and accumulated before wait(): right only when the "
            "collective happens to finish first",
    ),
    dict(
        name="rs_output_in_the_default_dtype",
        cell="reduce_scatter_gradients",
        replace=[("    mine = torch.empty_like(unit.shard)\n", "    mine = torch.empty(unit.layout.shard_numel)\n")],
        catches=["test_reduce_scatter_gradients"],
        why="the reduce-scatter's output is made in the default dtype: right for float32 models only (a hidden "
            "case has float64 parameters)",
    ),
    dict(
        name="rs_output_without_device",
        cell="reduce_scatter_gradients",
        replace=[("    mine = torch.empty_like(unit.shard)\n",
                  "    mine = torch.empty(unit.layout.shard_numel, dtype=unit.shard.dtype)\n")],
        catches=["test_zero_device"],
        why="the reduce-scatter's output is made without device=: right on CPU ranks, a CPU tensor for the "
            "GPU's collective on a GPU node (only the device check sees it)",
    ),
    dict(
        name="rs_keeps_a_full_gradient_buffer_per_unit",
        cell="reduce_scatter_gradients",
        code='''
def reduce_scatter_gradients(unit):
    """unit.shard.grad += average over ranks of this rank's shard of the unit's flat gradient."""
    if not hasattr(unit, "grad_buffer"):
        unit.grad_buffer = torch.zeros_like(unit.flat)      # allocated once, reused every step
    buffer = unit.grad_buffer
    buffer.zero_()
    for p, view in zip(unit.params, unit.layout.views(buffer)):
        if p.grad is not None:
            view.copy_(p.grad)
    mine = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(mine, buffer)
    mine.div_(dist.get_world_size())
    if unit.shard.grad is None:
        unit.shard.grad = mine
    else:
        unit.shard.grad += mine
    for p in unit.params:
        p.grad = None
''',
        catches=["test_zero2"],
        why="keeps a full-size gradient buffer per unit to avoid re-allocating it: every p.grad is dropped, yet "
            "the rank holds the whole gradient between steps, which is what ZeRO-2 removes",
    ),

    # ------------------------------------------------------------------ sharded_step
    dict(
        name="step_missing_all_gather",
        cell="sharded_step",
        replace=[("    for unit in units:\n        dist.all_gather_into_tensor(unit.flat, unit.shard.detach().clone())", "")],
        catches=["test_zero1_equal"],
        why="no all-gather after the sharded step: each rank only sees its own shard's updates",
    ),
    dict(
        name="step_all_gather_before_step",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    for unit in units:
        dist.all_gather_into_tensor(unit.flat, unit.shard.detach().clone())
    optimizer.step()
''',
        catches=["test_zero1_equal"],
        why="all-gathers before the update: the other ranks' shards are always one step behind",
    ),
    dict(
        name="step_all_reduce_parameters",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    for unit in units:
        mine = unit.shard.detach().clone()
        unit.flat.zero_()
        unit.layout.my_shard(unit.flat).copy_(mine)
        dist.all_reduce(unit.flat)
''',
        catches=["test_zero1_traffic_memory"],
        why="rebuilds the parameters with an all-reduce of zero-padded shards: right values, twice the traffic",
    ),
    dict(
        name="step_async_all_gathers_never_waited",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    for unit in units:      # async: the next forward is far away, let them run in the background
        dist.all_gather_into_tensor(unit.flat, unit.shard.detach().clone(), async_op=True)
''',
        catches=["test_zero1_equal"],
        why="launches the all-gathers with async_op=True and never waits: the next forward may read unit.flat "
            "before the other ranks' shards arrived",
    ),
    dict(
        name="step_one_coalesced_all_gather",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    world = dist.get_world_size()
    mine = torch.cat([u.shard.detach() for u in units])          # one message instead of one per unit
    everything = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(everything, mine)
    per_rank = everything.view(world, -1)
    start = 0
    for u in units:
        size = u.shard.numel()
        u.flat.copy_(per_rank[:, start:start + size].reshape(-1))
        start += size
''',
        catches=["test_zero1_traffic_memory"],
        why="one coalesced all-gather of every unit's shard into a buffer of the whole model: right values and "
            "bytes, but the step holds a second full copy of the parameters",
    ),

    # ------------------------------------------------------------------ gather / free (ZeRO-3)
    dict(
        name="zero3_never_frees",
        cell="gather_free",
        replace=[("    unit.flat.untyped_storage().resize_(0)", "    pass")],
        catches=["test_zero3_traffic_memory"],
        why="ZeRO-3 that never frees the gathered parameters: correct training, full parameter memory",
    ),
    dict(
        name="zero3_free_replaces_the_tensor",
        cell="gather_free",
        replace=[("    unit.flat.untyped_storage().resize_(0)", "    unit.flat = torch.empty(0, device=unit.flat.device)")],
        catches=["test_zero3_equal", "test_zero3_traffic_memory"],
        why="rebinds unit.flat instead of freeing its storage: the parameters still view the old memory, "
            "and the next gather writes into a tensor of the wrong size",
    ),
    dict(
        name="zero3_gather_copies_own_shard_only",
        cell="gather_free",
        replace=[("    dist.all_gather_into_tensor(unit.flat, unit.shard.detach())",
                  "    unit.layout.my_shard(unit.flat).copy_(unit.shard.detach())")],
        catches=["test_zero3_equal"],
        why="restores only this rank's shard after the free: the rest of the layer is whatever the "
            "re-allocated memory held",
    ),
    dict(
        name="zero3_frees_only_after_backward",
        cell="gather_free",
        replace=[("    unit.flat.untyped_storage().resize_(0)",
                  "    if unit.shard.grad is None:      # backward will need them again: keep until it is done\n"
                  "        return\n    unit.flat.untyped_storage().resize_(0)")],
        catches=["test_zero3_traffic_memory"],
        why="frees the parameters only once their gradient is reduced: right values, but every unit stays "
            "gathered between forward and backward (the whole model, not 1/N of it)",
    ),
    dict(
        name="zero3_gather_async_not_waited",
        cell="gather_free",
        replace=[("    dist.all_gather_into_tensor(unit.flat, unit.shard.detach())",
                  "    dist.all_gather_into_tensor(unit.flat, unit.shard.detach(), async_op=True)   # prefetch")],
        catches=["test_zero3_equal"],
        why="an async all-gather as a 'prefetch' that nobody waits for: the layer may compute with the memory "
            "the storage was re-allocated with",
    ),
    dict(
        name="zero3_gather_list_into_temporaries",
        cell="gather_free",
        replace=[("    dist.all_gather_into_tensor(unit.flat, unit.shard.detach())",
                  "    chunks = [torch.empty_like(unit.shard) for _ in range(dist.get_world_size())]\n"
                  "    dist.all_gather(chunks, unit.shard.detach())\n"
                  "    torch.cat(chunks)                 # the gathered parameters (never written into unit.flat)")],
        catches=["test_zero3_equal"],
        why="all-gathers into fresh tensors and concatenates them into a temporary that is thrown away: "
            "unit.flat keeps whatever its re-allocated memory held",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []

# correct implementations other than the solution's: each must get full marks
ALTERNATIVES = [
    # ------------------------------------------------------------------ reduce_scatter_gradients
    dict(
        name="rs_divide_before_reduce_scatter",
        cell="reduce_scatter_gradients",
        code='''
def reduce_scatter_gradients(unit):
    """unit.shard.grad += average over ranks of this rank's shard of the unit's flat gradient."""
    flat = unit.layout.flatten([p.grad for p in unit.params], like=unit.shard) / dist.get_world_size()
    mine = torch.zeros_like(unit.shard)
    dist.reduce_scatter_tensor(mine, flat)
    unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad.add_(mine)
    for p in unit.params:
        p.grad = None
''',
        why="divides the flat gradient by N before the reduce-scatter, accumulates with an in-place add_",
    ),
    dict(
        name="rs_flatten_and_pad_by_hand",
        cell="reduce_scatter_gradients",
        code='''
def reduce_scatter_gradients(unit):
    """unit.shard.grad += average over ranks of this rank's shard of the unit's flat gradient."""
    parts = [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in unit.params]
    flat = torch.cat(parts)
    flat = torch.cat([flat, flat.new_zeros(unit.layout.padded_numel - flat.numel())])
    mine = flat.new_empty(unit.layout.shard_numel)
    dist.reduce_scatter_tensor(mine, flat)
    mine.div_(dist.get_world_size())
    unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
    for p in unit.params:
        p.grad = None
''',
        why="flattens with torch.cat (zeros for a missing gradient, in place) and pads by hand instead of "
            "layout.flatten; accumulates out of place",
    ),
    dict(
        name="rs_fill_zero_buffer_through_views",
        cell="reduce_scatter_gradients",
        code='''
def reduce_scatter_gradients(unit):
    """unit.shard.grad += average over ranks of this rank's shard of the unit's flat gradient."""
    flat_grad = torch.zeros(unit.layout.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
    for p, view in zip(unit.params, unit.layout.views(flat_grad)):
        if p.grad is not None:               # a missing gradient stays zeros at its own place
            view.copy_(p.grad)
        p.grad = None                        # dropped as soon as it is packed
    mine = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(mine, flat_grad)
    mine /= dist.get_world_size()
    if unit.shard.grad is None:
        unit.shard.grad = mine
    else:
        unit.shard.grad.add_(mine)
''',
        why="packs the gradients into a zero buffer through layout.views (and drops each one as it is "
            "packed) instead of layout.flatten",
    ),

    # ------------------------------------------------------------------ sharded_step
    dict(
        name="step_all_gather_list_into_chunk_views",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    for u in units:
        dist.all_gather(list(u.flat.chunk(dist.get_world_size())), u.shard.detach().clone())
''',
        why="list form dist.all_gather straight into the N chunk views of unit.flat",
    ),
    dict(
        name="step_gather_into_temporary_then_copy",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    for u in units:
        full = torch.empty_like(u.flat)
        dist.all_gather_into_tensor(full, u.shard.detach())    # the input does not overlap `full`: no clone
        with torch.no_grad():
            u.flat.copy_(full)
''',
        why="all-gathers into a fresh buffer (so the shard needs no copy) and copies it into unit.flat",
    ),
    dict(
        name="step_async_all_gathers",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    works = [dist.all_gather_into_tensor(u.flat, u.shard.detach().clone(), async_op=True) for u in units]
    for work in works:
        work.wait()
''',
        why="launches every unit's all-gather with async_op=True, then waits for all of them",
    ),
    dict(
        name="step_all_gather_list_into_fresh_pieces",
        cell="sharded_step",
        code='''
def sharded_step(units, optimizer):
    """Update this rank's shards, then rebuild the full parameters on every rank."""
    optimizer.step()
    for u in units:
        pieces = [torch.empty_like(u.shard) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, u.shard.detach())
        with torch.no_grad():
            u.flat.copy_(torch.cat(pieces))
''',
        why="list form dist.all_gather into N fresh pieces per unit, concatenated into unit.flat",
    ),

    # ------------------------------------------------------------------ gather / free (ZeRO-3)
    dict(
        name="zero3_all_gather_list_into_chunk_views",
        cell="gather_free",
        replace=[("    dist.all_gather_into_tensor(unit.flat, unit.shard.detach())",
                  "    dist.all_gather(list(unit.flat.chunk(dist.get_world_size())), unit.shard.detach())")],
        why="the lab's other form: list dist.all_gather into the N chunk views of unit.flat",
    ),
    dict(
        name="zero3_all_gather_into_explicit_slices",
        cell="gather_free",
        code='''
def gather_parameters(unit):
    """Materialise the unit's full flat parameters from every rank's shard."""
    unit.flat.untyped_storage().resize_(unit.nbytes)
    n, size = dist.get_world_size(), unit.shard.numel()
    dist.all_gather([unit.flat[r * size:(r + 1) * size] for r in range(n)], unit.shard.detach())


def free_parameters(unit):
    """Release the memory of the unit's full flat parameters (keep the shard)."""
    unit.flat.untyped_storage().resize_(0)
    unit.gathered = False
''',
        why="list all_gather into slices of unit.flat computed from the shard size; free also sets "
            "unit.gathered itself (redundant with the wrapper)",
    ),
    dict(
        name="zero3_gather_into_temporary_then_copy",
        cell="gather_free",
        replace=[("    dist.all_gather_into_tensor(unit.flat, unit.shard.detach())",
                  "    full = torch.empty(unit.flat.shape, dtype=unit.flat.dtype, device=unit.flat.device)\n"
                  "    dist.all_gather_into_tensor(full, unit.shard.detach())\n"
                  "    with torch.no_grad():\n"
                  "        unit.flat.copy_(full)             # the temporary dies on return")],
        why="all-gathers into a temporary full buffer and copies it into the re-allocated unit.flat",
    ),
]
