"""Lab 2 (data parallelism): realistic wrong implementations.

Each bug replaces one solution cell of solutions/lab2_data_parallel/lab2_data_parallel.ipynb
and names the test cells that must lose points (format: solutions/BUGBANK.md).

The equality tests train with SGD + momentum (Adam would hide a wrong gradient scale), on
models with a frozen parameter and with a layer forward never uses; the traffic tests
count the traced all-reduces and their bytes; the overlap test compares the first
all-reduce's launch time with the moment backward produced its last gradient.
"""

BUGS = [
    # ------------------------------------------------------------------ split_batch
    dict(
        name="split_no_divisibility_check",
        cell="split_batch",
        replace=[("    if batch % world_size:\n        raise ValueError(f\"a batch of {batch} rows does not split "
                  "evenly into {world_size} ranks\")\n", "")],
        catches=["test_split_batch"],
        why="a batch of 10 on 4 ranks silently drops 2 rows (the average is then not the full-batch gradient)",
    ),
    dict(
        name="split_strided",
        cell="split_batch",
        code='''
def split_batch(x, y, rank, world_size):
    """Rank `rank`'s contiguous block of the global batch (x, y)."""
    if x.shape[0] % world_size:
        raise ValueError("batch does not divide by world_size")
    return x[rank::world_size], y[rank::world_size]
''',
        catches=["test_split_batch"],
        why="round-robin rows instead of the contiguous block the contract asks for",
    ),
    dict(
        name="split_whole_batch_everywhere",
        cell="split_batch",
        code='''
def split_batch(x, y, rank, world_size):
    """Rank `rank`'s contiguous block of the global batch (x, y)."""
    if x.shape[0] % world_size:
        raise ValueError("batch does not divide by world_size")
    return x, y
''',
        catches=["test_split_batch"],
        why="every rank trains on the whole batch: right answer, N times the work",
    ),
    dict(
        name="split_divisibility_on_numel",
        cell="split_batch",
        replace=[("    if batch % world_size:", "    if x.numel() % world_size:")],
        catches=["test_split_batch"],
        why="tests the number of elements, not of rows: a batch of 6 rows of 2 features on 4 ranks passes "
            "(12 elements) and silently drops rows",
    ),

    # ------------------------------------------------------------------ average_gradients
    dict(
        name="avg_forgets_to_average",
        cell="average_gradients",
        replace=[("\n        p.grad.div_(world)", "")],
        catches=["test_average_gradients_equal"],
        why="sum instead of mean: the step is N times too large",
    ),
    dict(
        name="avg_averages_twice",
        cell="average_gradients",
        replace=[("        dist.all_reduce(p.grad)\n", "        p.grad.div_(world)\n        dist.all_reduce(p.grad)\n")],
        catches=["test_average_gradients_equal"],
        why="divides before and after the all-reduce: the step is N times too small",
    ),
    dict(
        name="avg_all_reduces_a_temporary",
        cell="average_gradients",
        replace=[("        dist.all_reduce(p.grad)\n        p.grad.div_(world)",
                  "        dist.all_reduce(p.grad / world)")],
        catches=["test_average_gradients_equal"],
        why="all-reduces the temporary p.grad / world, so p.grad keeps the local gradient (no sync at all)",
    ),
    dict(
        name="avg_includes_frozen_parameters",
        cell="average_gradients",
        replace=[("        if not p.requires_grad:\n            continue\n", "")],
        catches=["test_average_gradients_traffic"],
        why="all-reduces zeros for frozen parameters: right parameters, wasted traffic",
    ),
    dict(
        name="avg_skips_missing_gradients",
        cell="average_gradients",
        replace=[("        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n",
                  "        if p.grad is None:          # nothing to average\n            continue\n")],
        catches=["test_average_gradients_equal"],
        why="skips a parameter without a gradient: fine when no rank used it, but a layer used on some ranks "
            "only gives the ranks different sequences of all-reduces (mismatched tensors, or a hang)",
    ),
    dict(
        name="avg_missing_gradient_without_device",
        cell="average_gradients",
        replace=[("            p.grad = torch.zeros_like(p)\n", "            p.grad = torch.zeros(p.shape)\n")],
        catches=["test_data_parallel_device"],
        why="the zero gradient of a layer this rank did not use is made without device=: right on CPU ranks, "
            "a CPU gradient for a GPU parameter on a GPU node (only the device check sees it)",
    ),
    dict(
        name="avg_reduces_zeros_it_throws_away",
        cell="average_gradients",
        replace=[("        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n",
                  "        if p.grad is None:          # take part in the all-reduce, keep no gradient\n"
                  "            dist.all_reduce(torch.zeros_like(p))\n            continue\n")],
        catches=["test_average_gradients_equal"],
        why="all-reduces a temporary of zeros for a missing gradient and discards the result: a rank that did "
            "not use the layer keeps no gradient while the others step with the mean (replicas drift apart)",
    ),
    dict(
        name="avg_async_divides_before_the_sum_arrives",
        cell="average_gradients",
        code='''
def average_gradients(model):
    """After backward: replace every trainable parameter's gradient by its mean over all ranks."""
    world = dist.get_world_size()
    works = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append(dist.all_reduce(p.grad, async_op=True))     # all of them in flight at once
        p.grad.div_(world)
    for work in works:
        work.wait()
''',
        catches=["test_average_gradients_equal"],
        why="divides a gradient while its async all-reduce is in flight: whether the sum includes the division "
            "depends on which finishes first (the checks read inputs at launch and write outputs at wait)",
    ),

    # ------------------------------------------------------------------ make_buckets
    dict(
        name="buckets_forward_order",
        cell="make_buckets",
        replace=[("for p in reversed(params):", "for p in params:")],
        catches=["test_make_buckets"],
        why="fills buckets from the first layer: the first bucket completes only at the end of backward",
    ),
    dict(
        name="buckets_drop_last",
        cell="make_buckets",
        replace=[("    if current:\n        buckets.append(current)\n", "")],
        catches=["test_make_buckets"],
        why="the last, partly filled bucket is never added: its parameters are never synchronised",
    ),
    dict(
        name="buckets_cap_off_by_one",
        cell="make_buckets",
        replace=[("size + nbytes > cap_bytes", "size + nbytes >= cap_bytes")],
        catches=["test_make_buckets"],
        why="a bucket of exactly cap_bytes is split (>= instead of >)",
    ),
    dict(
        name="buckets_assume_fp32",
        cell="make_buckets",
        replace=[("nbytes = p.numel() * p.element_size()", "nbytes = p.numel() * 4          # float32")],
        catches=["test_make_buckets"],
        why="sizes every parameter as 4 bytes per element: fp64 buckets grow to twice the cap, bf16 ones "
            "stay half full",
    ),

    # ------------------------------------------------------------------ BucketedDDP
    dict(
        name="ddp_forgets_to_average",
        cell="BucketedDDP",
        replace=[("            bucket.buffer.div_(self.world_size)\n", "")],
        catches=["test_bucketed_ddp_equal"],
        why="buckets are summed, never divided by the world size",
    ),
    dict(
        name="ddp_averages_twice",
        cell="BucketedDDP",
        replace=[("            bucket.work.wait()\n", "            bucket.work.wait()\n            bucket.buffer.div_(self.world_size)\n")],
        catches=["test_bucketed_ddp_equal"],
        why="divides before the all-reduce and again after the wait",
    ),
    dict(
        name="ddp_unused_bucket_never_fires",
        cell="BucketedDDP",
        replace=[("        for bucket in self.buckets[self.next_bucket:]:\n"
                  "            bucket.ready.update(id(p) for p in bucket.params)\n"
                  "        self.launch_ready_buckets()\n", ""),
                 ("            bucket.work.wait()\n", "            if bucket.work is not None:\n                bucket.work.wait()\n")],
        catches=["test_bucketed_ddp_equal", "test_bucketed_ddp_traffic"],
        why="a bucket holding an unused parameter never fills, so it and every later bucket are never "
            "all-reduced (local gradients are used)",
    ),
    dict(
        name="ddp_waits_for_unused_bucket_forever",
        cell="BucketedDDP",
        replace=[("        for bucket in self.buckets[self.next_bucket:]:\n"
                  "            bucket.ready.update(id(p) for p in bucket.params)\n"
                  "        self.launch_ready_buckets()\n",
                  "        while self.next_bucket < len(self.buckets):   # wait for the hooks to launch the rest\n"
                  "            time.sleep(0.01)\n")],
        catches=["test_bucketed_ddp_equal"],
        why="waits for the hook of an unused parameter, which never fires: a hang, which the test's "
            "launch timeout turns into a diagnosis",
    ),
    dict(
        name="ddp_no_overlap",
        cell="BucketedDDP",
        replace=[("        self.bucket_of[id(p)].ready.add(id(p))\n        self.launch_ready_buckets()\n",
                  "        self.bucket_of[id(p)].ready.add(id(p))\n")],
        catches=["test_bucketed_ddp_overlap"],
        why="hooks only mark gradients ready; every all-reduce starts after backward (right numbers, no overlap)",
    ),
    dict(
        name="ddp_per_parameter_all_reduce",
        cell="BucketedDDP",
        code='''
class BucketedDDP:
    """Data parallelism with gradient buckets whose all-reduces overlap backward."""

    def __init__(self, model, bucket_cap_bytes=1 << 20):
        self.model = model
        self.world_size = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = [Bucket(ps) for ps in make_buckets(params, bucket_cap_bytes)]
        self.params = params
        self.works = []
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def on_grad_ready(self, p):
        """Autograd calls this when p.grad is final for the current backward."""
        p.grad.div_(self.world_size)
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))

    def launch_ready_buckets(self):
        pass

    def finish_gradient_sync(self):
        """After backward: launch the buckets left over, wait for all, unpack the averages."""
        done = {id(p) for p, _ in self.works}
        for p in self.params:
            if id(p) not in done:
                p.grad = torch.zeros_like(p)
                self.works.append((p, dist.all_reduce(p.grad, async_op=True)))
        for _, work in self.works:
            work.wait()
        self.works = []
''',
        catches=["test_bucketed_ddp_traffic"],
        why="async all-reduce per parameter from the hooks: right result and overlap, but no buckets "
            "(one message per tensor)",
    ),
    dict(
        name="ddp_never_resets_between_steps",
        cell="BucketedDDP",
        replace=[("            bucket.reset()\n        self.next_bucket = 0", "            bucket.reset()")],
        catches=["test_bucketed_ddp_equal"],
        why="next_bucket is not reset after the step: from the second step on nothing is launched",
    ),
    dict(
        name="ddp_launches_buckets_as_they_fill",
        cell="BucketedDDP",
        replace=[("        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].is_full():\n"
                  "            bucket = self.buckets[self.next_bucket]\n"
                  "            bucket.pack()\n"
                  "            bucket.buffer.div_(self.world_size)\n"
                  "            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n"
                  "            self.next_bucket += 1\n",
                  "        for bucket in self.buckets:       # whichever is full first goes first\n"
                  "            if bucket.work is None and bucket.is_full():\n"
                  "                bucket.pack()\n"
                  "                bucket.buffer.div_(self.world_size)\n"
                  "                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n")],
        catches=["test_bucketed_ddp_equal"],
        why="launches buckets in the order they fill: right on models whose hooks fire in the same order on "
            "every rank, wrong sums when two branches are computed in another order on other ranks",
    ),
    dict(
        name="ddp_waits_in_the_hook",
        cell="BucketedDDP",
        replace=[("            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n",
                  "            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n"
                  "            bucket.work.wait()            # make sure it arrived before going on\n")],
        catches=["test_bucketed_ddp_overlap"],
        why="waits for each bucket's all-reduce inside the hook: it starts early but backward stalls until it "
            "completes, so nothing overlaps",
    ),
    dict(
        name="ddp_waits_only_for_the_last_bucket",
        cell="BucketedDDP",
        replace=[("        for bucket in self.buckets:\n            bucket.work.wait()\n",
                  "        self.buckets[-1].work.wait()       # collectives finish in the order they started\n"
                  "        for bucket in self.buckets:\n")],
        catches=["test_bucketed_ddp_equal"],
        why="waits for the last bucket only, assuming the all-reduces finish in order: gloo runs them on several "
            "threads (before outputs landed at wait, the visible check caught it in 10 of 20 runs; now in every run)",
    ),
    dict(
        name="ddp_blocking_all_reduce",
        cell="BucketedDDP",
        replace=[("            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n",
                  "            dist.all_reduce(bucket.buffer)\n            bucket.work = bucket\n"),
                 ("        for bucket in self.buckets:\n            bucket.work.wait()\n",
                  "        for bucket in self.buckets:\n")],
        catches=["test_bucketed_ddp_overlap"],
        why="all-reduce without async_op from the hook: the right numbers, launched early, but backward "
            "blocks on every bucket",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []

# correct implementations other than the solution's: each must get full marks
_BUCKETED_TESTS = ["test_make_buckets", "test_bucketed_ddp_equal", "test_bucketed_ddp_traffic",
                   "test_bucketed_ddp_overlap"]     # BucketedDDP builds its buckets with make_buckets

ALTERNATIVES = [
    # ------------------------------------------------------------------ split_batch
    dict(
        name="split_narrow_divmod",
        cell="split_batch",
        code='''
def split_batch(x, y, rank, world_size):
    """Rank `rank`'s contiguous block of the global batch (x, y)."""
    rows, rest = divmod(len(y), world_size)
    if rest:
        raise ValueError(f"{len(y)} rows on {world_size} ranks")
    return x.narrow(0, rank * rows, rows), y.narrow(0, rank * rows, rows)
''',
        why="divmod for the check, Tensor.narrow for the block",
    ),
    dict(
        name="split_torch_chunk",
        cell="split_batch",
        code='''
def split_batch(x, y, rank, world_size):
    """Rank `rank`'s contiguous block of the global batch (x, y)."""
    if x.size(0) % world_size != 0:
        raise ValueError("uneven batch")
    return torch.chunk(x, world_size)[rank], torch.chunk(y, world_size)[rank]
''',
        why="torch.chunk into world_size pieces (equal once the batch divides), takes piece `rank`",
    ),
    dict(
        name="split_by_block_size",
        cell="split_batch",
        code='''
def split_batch(x, y, rank, world_size):
    """Rank `rank`'s contiguous block of the global batch (x, y)."""
    local, rest = divmod(x.shape[0], world_size)
    if rest:
        raise ValueError(f"batch {x.shape[0]} is not a multiple of world_size {world_size}")
    return x.split(local)[rank], y.split(local)[rank]
''',
        why="Tensor.split into blocks of B / world_size rows, takes block `rank`",
    ),

    # ------------------------------------------------------------------ average_gradients
    dict(
        name="avg_divide_before_all_reduce",
        cell="average_gradients",
        code='''
def average_gradients(model):
    """After backward: replace every trainable parameter's gradient by its mean over all ranks."""
    n = dist.get_world_size()
    for p in (q for q in model.parameters() if q.requires_grad):
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad / n
        dist.all_reduce(p.grad)
''',
        why="divides each gradient by N out of place first, then all-reduces the scaled copy held in p.grad",
    ),
    dict(
        name="avg_all_reduce_a_copy",
        cell="average_gradients",
        code='''
def average_gradients(model):
    """After backward: replace every trainable parameter's gradient by its mean over all ranks."""
    for p in model.parameters():
        if p.requires_grad:
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g)
            p.grad = g / dist.get_world_size()
''',
        why="all-reduces a clone and assigns a new averaged tensor to p.grad (out of place)",
    ),
    dict(
        name="avg_async_then_wait_all",
        cell="average_gradients",
        code='''
def average_gradients(model):
    """After backward: replace every trainable parameter's gradient by its mean over all ranks."""
    world = dist.get_world_size()
    pending = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        pending.append((p.grad, dist.all_reduce(p.grad, async_op=True)))
    for grad, work in pending:
        work.wait()
        grad.div_(world)
''',
        why="launches every all-reduce with async_op=True, then waits for all and divides",
    ),

    # ------------------------------------------------------------------ make_buckets
    dict(
        name="buckets_model_order_inside",
        cell="make_buckets",
        replace=[("        current.append(p)\n", "        current.insert(0, p)          # keep model order inside a bucket\n")],
        tests=_BUCKETED_TESTS,
        why="same buckets in the same order, each listed in model order (the contract leaves the order "
            "inside a bucket free)",
    ),
    dict(
        name="buckets_cut_points_in_place_reverse",
        cell="make_buckets",
        code='''
def make_buckets(params, cap_bytes):
    """Greedy buckets of at most `cap_bytes`, filled in reverse parameter order."""
    params.reverse()
    cuts, size = [0], 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if i > cuts[-1] and size + nbytes > cap_bytes:
            cuts.append(i)
            size = 0
        size += nbytes
    return [params[a:b] for a, b in zip(cuts, cuts[1:] + [len(params)])]
''',
        tests=_BUCKETED_TESTS,
        why="reverses the caller's list in place, computes the cut points first, then slices",
    ),
    dict(
        name="buckets_look_ahead",
        cell="make_buckets",
        code='''
def make_buckets(params, cap_bytes):
    """Greedy buckets of at most `cap_bytes`, filled in reverse parameter order."""
    order = list(reversed(params))
    sizes = [p.numel() * p.element_size() for p in order]
    buckets, start = [], 0
    while start < len(order):
        end, total = start + 1, sizes[start]          # a bucket always takes at least one tensor
        while end < len(order) and total + sizes[end] <= cap_bytes:
            total += sizes[end]
            end += 1
        buckets.append(order[start:end])
        start = end
    return buckets
''',
        tests=_BUCKETED_TESTS,
        why="index loop that grows each bucket while the next tensor still fits (look-ahead), then slices",
    ),

    # ------------------------------------------------------------------ BucketedDDP
    dict(
        name="ddp_divide_after_wait",
        cell="BucketedDDP",
        replace=[("            bucket.buffer.div_(self.world_size)\n", ""),
                 ("            bucket.work.wait()\n",
                  "            bucket.work.wait()\n            bucket.buffer.div_(self.world_size)\n")],
        why="all-reduces the sum and divides by the world size after wait() instead of before the launch",
    ),
    dict(
        name="ddp_without_bucket_helper",
        cell="BucketedDDP",
        code='''
class BucketedDDP:
    """Data parallelism with gradient buckets whose all-reduces overlap backward."""

    def __init__(self, model, bucket_cap_bytes=1 << 20):
        self.model, self.n = model, dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = make_buckets(params, bucket_cap_bytes)
        self.where = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.ready, self.works, self.flats = [0] * len(self.buckets), [], []
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def on_grad_ready(self, p):
        """Autograd calls this when p.grad is final for the current backward."""
        self.ready[self.where[id(p)]] += 1
        self.launch_ready_buckets()

    def launch_ready_buckets(self, force=False):
        """Start the async all-reduce of every full bucket, strictly in bucket order."""
        while len(self.works) < len(self.buckets):
            k = len(self.works)
            if not force and self.ready[k] < len(self.buckets[k]):
                return
            flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                              for p in self.buckets[k]])
            self.flats.append(flat)
            self.works.append(dist.all_reduce(flat, async_op=True))

    def finish_gradient_sync(self):
        """After backward: launch the buckets left over, wait for all, unpack the averages."""
        self.launch_ready_buckets(force=True)
        for b, flat, work in zip(self.buckets, self.flats, self.works):
            work.wait()
            flat /= self.n
            for p, g in zip(b, flat.split([p.numel() for p in b])):
                p.grad = g.view_as(p).clone()
        self.ready, self.works, self.flats = [0] * len(self.buckets), [], []
''',
        why="no Bucket helper: a ready count per bucket, torch.cat into a fresh flat tensor, the mean taken "
            "after the wait, split back into new gradients",
    ),
    dict(
        name="ddp_leftovers_from_autograd_callback",
        cell="BucketedDDP",
        replace=[("        self.bucket_of[id(p)].ready.add(id(p))\n        self.launch_ready_buckets()\n",
                  "        if not getattr(self, \"callback_queued\", False):     # once per backward\n"
                  "            self.callback_queued = True\n"
                  "            torch.autograd.Variable._execution_engine.queue_callback(self.launch_leftovers)\n"
                  "        self.bucket_of[id(p)].ready.add(id(p))\n        self.launch_ready_buckets()\n\n"
                  "    def launch_leftovers(self):\n"
                  "        \"\"\"Runs when backward ends: buckets with unused parameters go now, counted as zeros.\"\"\"\n"
                  "        for bucket in self.buckets[self.next_bucket:]:\n"
                  "            bucket.ready.update(id(p) for p in bucket.params)\n"
                  "        self.launch_ready_buckets()\n"),
                 ("        for bucket in self.buckets[self.next_bucket:]:\n"
                  "            bucket.ready.update(id(p) for p in bucket.params)\n"
                  "        self.launch_ready_buckets()\n"
                  "        for bucket in self.buckets:\n",
                  "        self.launch_leftovers()             # a no-op when the callback already ran\n"
                  "        for bucket in self.buckets:\n"),
                 ("            bucket.reset()\n        self.next_bucket = 0",
                  "            bucket.reset()\n        self.next_bucket = 0\n        self.callback_queued = False")],
        why="launches the buckets left over (unused parameters) from an autograd end-of-backward callback "
            "queued by the first hook, as torch's DDP does; finish_gradient_sync only waits",
    ),
    dict(
        name="ddp_gradients_as_bucket_views",
        cell="BucketedDDP",
        replace=[("            bucket.unpack()\n",
                  "            for p, view in zip(bucket.params, bucket.views):\n"
                  "                p.grad = view             # the gradient IS its slice of the bucket: no copy back\n")],
        why="after the wait, points every p.grad at its view of the bucket buffer instead of copying "
            "the buffer back (gradient_as_bucket_view)",
    ),
]
