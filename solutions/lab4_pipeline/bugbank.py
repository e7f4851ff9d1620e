"""Lab 4 (pipeline parallelism): realistic wrong implementations.

Each bug replaces one solution cell of solutions/lab4_pipeline/lab4_pipeline.ipynb and
names the test cells that must lose points (format: solutions/BUGBANK.md).

The executor tests run the student's executor with the library's schedules, so schedule
bugs fail only the schedule tests. A deadlocking executor fails through the test's
``minidist.launch(..., timeout=15)``, not the cell timeout.
"""

GPIPE = "test_gpipe_schedule"
ONE_F_ONE_B = "test_1f1b_schedule"
GRADS = "test_run_pipeline_gradients"
MEMORY = "test_run_pipeline_memory_and_bubble"

BUGS = [
    # ------------------------------------------------------------------ gpipe_schedule
    dict(
        name="gpipe_no_microbatches",
        cell="gpipe_schedule",
        code='''
def gpipe_schedule(p, m):
    """GPipe: on every rank, all m forwards then all m backwards, with their messages."""
    actions = []
    for r in range(p):
        prog = []
        if r > 0:
            prog.append(Action("RECV_F", 0, peer=r - 1))
        prog.append(Action("F", 0))
        if r < p - 1:
            prog.append(Action("SEND_F", 0, peer=r + 1))
            prog.append(Action("RECV_B", 0, peer=r + 1))
        prog.append(Action("B", 0))
        if r > 0:
            prog.append(Action("SEND_B", 0, peer=r - 1))
        actions.append(prog)
    return Schedule("gpipe", p, 1, 1, actions)
''',
        catches=[GPIPE],
        why="GPipe without micro-batch splitting: the whole batch goes through as one (naive pipelining)",
    ),
    dict(
        name="gpipe_one_microbatch_at_a_time",
        cell="gpipe_schedule",
        code='''
def gpipe_schedule(p, m):
    """GPipe: on every rank, all m forwards then all m backwards, with their messages."""
    actions = []
    for r in range(p):
        prog = []
        for i in range(m):
            if r > 0:
                prog.append(Action("RECV_F", i, peer=r - 1))
            prog.append(Action("F", i))
            if r < p - 1:
                prog.append(Action("SEND_F", i, peer=r + 1))
                prog.append(Action("RECV_B", i, peer=r + 1))
            prog.append(Action("B", i))
            if r > 0:
                prog.append(Action("SEND_B", i, peer=r - 1))
        actions.append(prog)
    return Schedule("gpipe", p, m, 1, actions)
''',
        catches=[GPIPE],
        why="each micro-batch's forward and backward back to back: m naive pipelines in a row, bubble (p-1)/p",
    ),
    dict(
        name="gpipe_recv_after_forward",
        cell="gpipe_schedule",
        replace=[('''            if r > 0:
                prog.append(Action("RECV_F", i, peer=r - 1))
            prog.append(Action("F", i))''', '''            prog.append(Action("F", i))
            if r > 0:
                prog.append(Action("RECV_F", i, peer=r - 1))''')],
        catches=[GPIPE],
        why="the forward runs before its input activation has been received",
    ),

    # ------------------------------------------------------------------ one_f_one_b_schedule
    dict(
        name="1f1b_warmup_off_by_one",
        cell="one_f_one_b_schedule",
        replace=[("warmup = min(p - r - 1, m)", "warmup = min(p - r, m)")],
        catches=[ONE_F_ONE_B],
        why="wrong warmup count: p - r forwards, one too many (rank r holds p - r + 1 micro-batches)",
    ),
    dict(
        name="1f1b_warmup_ignores_rank",
        cell="one_f_one_b_schedule",
        replace=[("warmup = min(p - r - 1, m)", "warmup = min(p - 1, m)")],
        catches=[ONE_F_ONE_B],
        why="wrong warmup count: every rank warms up with p - 1 forwards, as if it were rank 0",
    ),
    dict(
        name="1f1b_warmup_not_capped_by_m",
        cell="one_f_one_b_schedule",
        replace=[("warmup = min(p - r - 1, m)", "warmup = p - r - 1")],
        catches=[ONE_F_ONE_B],
        why="wrong warmup count when m < p: forwards of micro-batches that do not exist",
    ),
    dict(
        name="1f1b_step_receives_all_first",
        cell="one_f_one_b_schedule",
        replace=[("prog += forward(r, i + warmup) + backward(r, i)",
                  "step = forward(r, i + warmup) + backward(r, i)\n"
                  "            prog += [a for a in step if a.kind.startswith('RECV')] + "
                  "[a for a in step if not a.kind.startswith('RECV')]")],
        catches=[ONE_F_ONE_B],
        why="each step waits for the gradient before its forward: valid, but the pipeline stalls (bubble above theory)",
    ),

    # ------------------------------------------------------------------ run_pipeline
    dict(
        name="executor_no_loss_scaling",
        cell="run_pipeline",
        replace=[("out = F.mse_loss(out, ys[a.mb]) / s.m", "out = F.mse_loss(out, ys[a.mb])")],
        catches=[GRADS],
        why="missing loss scaling: the m micro-batch gradients are summed, not averaged (m times too large)",
    ),
    dict(
        name="executor_blocking_send_recv",
        cell="run_pipeline",
        replace=[("pending_sends.append((dist.isend(tensor, dst=a.peer), tensor))", "dist.send(tensor, dst=a.peer)"),
                 ("recvs.append(dist.irecv(received[key], src=a.peer))", "dist.recv(received[key], src=a.peer)")],
        catches=[GRADS, MEMORY],
        why="blocking send/recv one action at a time: in 1F1B's steady state neighbours both sit in send (deadlock)",
    ),
    dict(
        name="executor_whole_batch_per_microbatch",
        cell="run_pipeline",
        replace=[("xs, ys = x.chunk(s.m), y.chunk(s.m)", "xs, ys = [x] * s.m, [y] * s.m")],
        catches=[MEMORY],
        why="GPipe without micro-batch splitting: every micro-batch is the whole batch (gradients still right "
            "thanks to 1/m, but m times the activation memory and compute)",
    ),
    dict(
        name="executor_keeps_graphs",
        cell="run_pipeline",
        replace=[("inp, out = stored.pop(key)", "inp, out = stored[key]"),
                 ("torch.autograd.backward(out, grad)", "torch.autograd.backward(out, grad, retain_graph=True)")],
        catches=[MEMORY],
        why="retain_graph=True and micro-batches never forgotten: 1F1B holds all m activations, like GPipe",
    ),
    dict(
        name="executor_zero_grad_per_microbatch",
        cell="run_pipeline",
        replace=[("inp, out = stored.pop(key)", "inp, out = stored.pop(key)\n                chunks[a.chunk].zero_grad()")],
        catches=[GRADS],
        why="gradients zeroed before every backward: only the last micro-batch's gradient survives",
    ),
    dict(
        name="executor_waits_receives_at_the_end",
        cell="run_pipeline",
        replace=[("            for request in recvs:\n                request.wait()\n",
                  "            pending_sends.extend((request, None) for request in recvs)   # waited with the sends\n")],
        catches=[GRADS],
        why="never waits for a receive before computing with it: the stage reads its input buffer whenever the "
            "message has happened to arrive (waited only at the end, with the sends)",
    ),
    dict(
        name="executor_buffers_default_dtype",
        cell="run_pipeline",
        replace=[("torch.empty(xs[0].shape, dtype=x.dtype, device=x.device)", "torch.empty(xs[0].shape, device=x.device)")],
        catches=[GRADS],
        why="receive buffers in the default dtype: right in float32 only (a hidden case trains in float64)",
    ),
    dict(
        name="executor_buffers_without_device",
        cell="run_pipeline",
        replace=[("torch.empty(xs[0].shape, dtype=x.dtype, device=x.device)", "torch.empty(xs[0].shape, dtype=x.dtype)")],
        catches=["test_run_pipeline_device"],
        why="receive buffers made without device=: right on CPU ranks, a CPU buffer for NCCL's receive on a GPU "
            "node (only the device check sees it)",
    ),
    dict(
        name="executor_loss_only_in_elif",
        cell="run_pipeline",
        replace=[('''                inp = xs[a.mb] if stage == 0 else received.pop(("act", *key)).requires_grad_()
                out = chunks[a.chunk](inp)
                if stage == last:
                    out = F.mse_loss(out, ys[a.mb]) / s.m
                    loss = out.item() + (loss or 0.0)
                else:
                    outgoing[("act", *key)] = out.detach()''', '''                if stage == 0:                          # the first stage reads the batch and sends on
                    inp = xs[a.mb]
                    out = chunks[a.chunk](inp)
                    outgoing[("act", *key)] = out.detach()
                elif stage == last:                     # the last stage computes the loss
                    inp = received.pop(("act", *key)).requires_grad_()
                    out = F.mse_loss(chunks[a.chunk](inp), ys[a.mb]) / s.m
                    loss = out.item() + (loss or 0.0)
                else:
                    inp = received.pop(("act", *key)).requires_grad_()
                    out = chunks[a.chunk](inp)
                    outgoing[("act", *key)] = out.detach()''')],
        catches=[GRADS],
        why="the loss only in an elif after the first stage's branch: with p = 1 the one stage never computes it",
    ),
    dict(
        name="executor_consumes_schedule",
        cell="run_pipeline",
        code='''
def run_pipeline(schedule, chunks, x, y, costs=None):
    """Run one training step's forwards and backwards of `schedule` on this rank.
    Returns the full-batch loss on the rank holding the last stage, None elsewhere."""
    s, rank = schedule, dist.get_rank()
    last = s.num_stages - 1
    xs, ys = x.chunk(s.m), y.chunk(s.m)
    received, outgoing, stored = {}, {}, {}
    pending_sends, loss = [], None
    todo = s.actions[rank]                    # popped from the front as it runs
    while todo:
        if todo[0].is_comm:
            recvs = []
            while todo and todo[0].is_comm:
                a = todo.pop(0)
                key = ("act" if a.kind.endswith("_F") else "grad", a.mb, a.chunk)
                if a.kind.startswith("SEND"):
                    tensor = outgoing.pop(key)
                    pending_sends.append((dist.isend(tensor, dst=a.peer), tensor))
                else:
                    received[key] = torch.empty(xs[0].shape, dtype=x.dtype, device=x.device)
                    recvs.append(dist.irecv(received[key], src=a.peer))
            for request in recvs:
                request.wait()
            continue
        a = todo.pop(0)
        key, stage = (a.mb, a.chunk), s.stage(rank, a.chunk)
        with timed(a, costs):
            if a.kind == "F":
                inp = xs[a.mb] if stage == 0 else received.pop(("act", *key)).requires_grad_()
                out = chunks[a.chunk](inp)
                if stage == last:
                    out = F.mse_loss(out, ys[a.mb]) / s.m
                    loss = out.item() + (loss or 0.0)
                else:
                    outgoing[("act", *key)] = out.detach()
                stored[key] = (inp, out)
            else:
                inp, out = stored.pop(key)
                torch.autograd.backward(out, None if stage == last else received.pop(("grad", *key)))
                if stage > 0:
                    outgoing[("grad", *key)] = inp.grad
    for request, _ in pending_sends:
        request.wait()
    return loss
''',
        catches=[GRADS],
        why="pops the actions off the schedule it was given: a second step with the same schedule does nothing",
    ),
    dict(
        name="executor_never_frees",
        cell="run_pipeline",
        replace=[("inp, out = stored.pop(key)", "inp, out = stored[key]"),
                 ('received.pop(("act", *key))', 'received[("act", *key)]'),
                 ('received.pop(("grad", *key))', 'received[("grad", *key)]')],
        catches=[MEMORY],
        why="stage inputs, outputs and receive buffers kept in their dicts until the step ends: all m micro-batches alive",
    ),
]

# Correct implementations other than the solution's: each must get full marks (format:
# solutions/BUGBANK.md). Without `tests`, an alternative must pass every test that a
# bug of its cell must fail (the schedule's own test; both executor tests for run_pipeline).
ALTERNATIVES = [
    # ------------------------------------------------------------------ gpipe_schedule
    dict(
        name="gpipe_backwards_in_reverse",
        cell="gpipe_schedule",
        replace=[('''        for i in range(m):
            if r < p - 1:
                prog.append(Action("RECV_B", i, peer=r + 1))''', '''        for i in reversed(range(m)):
            if r < p - 1:
                prog.append(Action("RECV_B", i, peer=r + 1))''')],
        why="backwards in the order m-1, ..., 0 (last in, first out), which the lab allows: "
            "\"Backwards may go in any order of micro-batches\"",
    ),
    dict(
        name="gpipe_forward_backward_helpers",
        cell="gpipe_schedule",
        code='''
def gpipe_schedule(p, m):
    """GPipe: on every rank, all m forwards then all m backwards, with their messages."""
    def forward(r, i):
        recv = [Action("RECV_F", i, peer=r - 1)] if r > 0 else []
        send = [Action("SEND_F", i, peer=r + 1)] if r < p - 1 else []
        return recv + [Action("F", i)] + send

    def backward(r, i):
        recv = [Action("RECV_B", i, peer=r + 1)] if r < p - 1 else []
        send = [Action("SEND_B", i, peer=r - 1)] if r > 0 else []
        return recv + [Action("B", i)] + send

    return Schedule("gpipe", p, m, 1, [[a for i in range(m) for a in forward(r, i)] +
                                       [a for i in range(m) for a in backward(r, i)] for r in range(p)])
''',
        why="per-micro-batch helpers that wrap a compute in its receive and send, and one comprehension per rank",
    ),
    dict(
        name="gpipe_compute_order_then_messages",
        cell="gpipe_schedule",
        code='''
def gpipe_schedule(p, m):
    """GPipe: on every rank, all m forwards then all m backwards, with their messages."""
    actions = []
    for r in range(p):
        computes = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
        prog = []
        for a in computes:
            # the message a compute needs comes right before it, the one it produces right after
            if a.kind == "F":
                before = Action("RECV_F", a.mb, peer=r - 1) if r > 0 else None
                after = Action("SEND_F", a.mb, peer=r + 1) if r < p - 1 else None
            else:
                before = Action("RECV_B", a.mb, peer=r + 1) if r < p - 1 else None
                after = Action("SEND_B", a.mb, peer=r - 1) if r > 0 else None
            prog += [b for b in (before, a, after) if b is not None]
        actions.append(prog)
    return Schedule("gpipe", p, m, 1, actions)
''',
        why="lists the compute order first, then inserts each compute's receive before it and send after it",
    ),

    # ------------------------------------------------------------------ one_f_one_b_schedule
    dict(
        name="1f1b_in_flight_limit",
        cell="one_f_one_b_schedule",
        code='''
def one_f_one_b_schedule(p, m):
    """1F1B: warmup forwards, then one forward and one backward per step, then cooldown."""
    actions = []
    for r in range(p):
        limit = p - r              # micro-batches rank r may hold at once
        prog, forwards, backwards = [], 0, 0
        while backwards < m:
            if forwards < m and forwards - backwards < limit:
                i, forwards = forwards, forwards + 1
                if r > 0:
                    prog.append(Action("RECV_F", i, peer=r - 1))
                prog.append(Action("F", i))
                if r < p - 1:
                    prog.append(Action("SEND_F", i, peer=r + 1))
            else:
                i, backwards = backwards, backwards + 1
                if r < p - 1:
                    prog.append(Action("RECV_B", i, peer=r + 1))
                prog.append(Action("B", i))
                if r > 0:
                    prog.append(Action("SEND_B", i, peer=r - 1))
        actions.append(prog)
    return Schedule("1f1b", p, m, 1, actions)
''',
        why="no explicit phases: run a forward while fewer than p - r micro-batches are in flight, else "
            "a backward (warmup, steady state and cooldown fall out)",
    ),
    dict(
        name="1f1b_compute_order_then_messages",
        cell="one_f_one_b_schedule",
        code='''
def one_f_one_b_schedule(p, m):
    """1F1B: warmup forwards, then one forward and one backward per step, then cooldown."""
    actions = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(warmup, m):
            order += [("F", i), ("B", i - warmup)]
        order += [("B", i) for i in range(m - warmup, m)]
        prog = []
        for kind, i in order:
            if kind == "F":
                prog += [Action("RECV_F", i, peer=r - 1)] * (r > 0) + [Action("F", i)] + \\
                        [Action("SEND_F", i, peer=r + 1)] * (r < p - 1)
            else:
                prog += [Action("RECV_B", i, peer=r + 1)] * (r < p - 1) + [Action("B", i)] + \\
                        [Action("SEND_B", i, peer=r - 1)] * (r > 0)
        actions.append(prog)
    return Schedule("1f1b", p, m, 1, actions)
''',
        why="builds the compute order first (steady state indexed by the forward's micro-batch), then "
            "adds the messages around each compute",
    ),
    dict(
        name="1f1b_group_receives_before_sends",
        cell="one_f_one_b_schedule",
        code='''
def one_f_one_b_schedule(p, m):
    """1F1B: warmup forwards, then one forward and one backward per step, then cooldown."""
    def forward(r, i):
        return ([Action("RECV_F", i, peer=r - 1)] if r > 0 else []) + [Action("F", i)] + \\
               ([Action("SEND_F", i, peer=r + 1)] if r < p - 1 else [])

    def backward(r, i):
        return ([Action("RECV_B", i, peer=r + 1)] if r < p - 1 else []) + [Action("B", i)] + \\
               ([Action("SEND_B", i, peer=r - 1)] if r > 0 else [])

    actions = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        prog = []
        for i in range(warmup):
            prog += forward(r, i)
        for i in range(m - warmup):
            prog += forward(r, i + warmup) + backward(r, i)
        for i in range(m - warmup, m):
            prog += backward(r, i)
        # Inside each group of consecutive messages, list the receives first: the executor
        # posts a whole group at once, so the order inside it does not matter.
        ordered, group = [], []
        for a in prog + [None]:
            if a is not None and a.is_comm:
                group.append(a)
                continue
            ordered += sorted(group, key=lambda g: not g.kind.startswith("RECV"))
            group = []
            if a is not None:
                ordered.append(a)
        actions.append(ordered)
    return Schedule("1f1b", p, m, 1, actions)
''',
        why="the steady state's merged group lists RECV_B before SEND_F (and RECV_F before SEND_B): same "
            "groups, another order inside them",
    ),

    # ------------------------------------------------------------------ run_pipeline
    dict(
        name="executor_segments_first",
        cell="run_pipeline",
        code='''
def run_pipeline(schedule, chunks, x, y, costs=None):
    """Run one training step's forwards and backwards of `schedule` on this rank.
    Returns the full-batch loss on the rank holding the last stage, None elsewhere."""
    rank, m = dist.get_rank(), schedule.m
    last = schedule.num_stages - 1
    xs, ys = x.chunk(m), y.chunk(m)
    # Cut the program into segments: a list of consecutive messages, or one compute.
    segments = []
    for a in schedule.actions[rank]:
        if a.is_comm and segments and isinstance(segments[-1], list):
            segments[-1].append(a)
        else:
            segments.append([a] if a.is_comm else a)
    acts, grads = {}, {}                  # received activations / gradients, by (mb, chunk)
    inputs, outputs = {}, {}              # what the backward needs, by (mb, chunk)
    to_send, sent, total = {}, [], 0.0
    for seg in segments:
        if isinstance(seg, list):
            waits = []
            for a in seg:
                key = (a.kind[-1], a.mb, a.chunk)
                if a.kind.startswith("SEND"):
                    tensor = to_send.pop(key)
                    sent.append((tensor, dist.isend(tensor, dst=a.peer)))
                else:
                    buf = torch.empty_like(xs[0])
                    (acts if a.kind == "RECV_F" else grads)[a.mb, a.chunk] = buf
                    waits.append(dist.irecv(buf, src=a.peer))
            for w in waits:
                w.wait()
            continue
        a = seg
        k, stage = (a.mb, a.chunk), schedule.stage(rank, a.chunk)
        with timed(a, costs):
            if a.kind == "F":
                inp = xs[a.mb] if stage == 0 else acts.pop(k).requires_grad_()
                out = chunks[a.chunk](inp)
                if stage == last:
                    out = F.mse_loss(out, ys[a.mb]) / m
                    total += out.item()
                else:
                    to_send["F", a.mb, a.chunk] = out.detach()
                inputs[k], outputs[k] = inp, out
            else:
                inp, out = inputs.pop(k), outputs.pop(k)
                out.backward(None if stage == last else grads.pop(k))
                if stage > 0:
                    to_send["B", a.mb, a.chunk] = inp.grad
    for _, request in sent:
        request.wait()
    return total if last in [schedule.stage(rank, c) for c in range(schedule.v)] else None
''',
        why="cuts the program into message groups and computes before running it; separate dicts for "
            "received activations and gradients; out.backward(grad); returns the loss if it holds the last stage",
    ),
    dict(
        name="executor_unscaled_loss_scaled_seed",
        cell="run_pipeline",
        replace=[("out = F.mse_loss(out, ys[a.mb]) / s.m\n                    loss = out.item() + (loss or 0.0)",
                  "out = F.mse_loss(out, ys[a.mb])\n                    loss = out.item() / s.m + (loss or 0.0)"),
                 ('grad = None if stage == last else received.pop(("grad", *key))',
                  'grad = torch.tensor(1.0 / s.m, dtype=out.dtype, device=out.device) if stage == last else received.pop(("grad", *key))')],
        why="keeps each micro-batch loss unscaled and seeds its backward with 1/m instead (the same gradients)",
    ),
    dict(
        name="executor_autograd_grad_accumulates",
        cell="run_pipeline",
        replace=[('                torch.autograd.backward(out, grad)\n                if stage > 0:\n'
                  '                    outgoing[("grad", *key)] = inp.grad',
                  '                params = [q for q in chunks[a.chunk].parameters() if q.requires_grad]\n'
                  '                wrt = params + ([inp] if stage > 0 else [])\n'
                  '                found = torch.autograd.grad(out, wrt, grad)\n'
                  '                for q, g in zip(params, found):\n'
                  '                    q.grad = g if q.grad is None else q.grad + g\n'
                  '                if stage > 0:\n'
                  '                    outgoing[("grad", *key)] = found[-1]')],
        why="torch.autograd.grad for the weights and the stage input, accumulating .grad by hand, "
            "instead of torch.autograd.backward",
    ),
    dict(
        name="executor_waits_each_receive_when_needed",
        cell="run_pipeline",
        code='''
def run_pipeline(schedule, chunks, x, y, costs=None):
    """Run one training step's forwards and backwards of `schedule` on this rank.
    Returns the full-batch loss on the rank holding the last stage, None elsewhere."""
    s, rank = schedule, dist.get_rank()
    last = s.num_stages - 1
    xs, ys = x.chunk(s.m), y.chunk(s.m)
    arriving = {}                  # key -> (buffer, request): posted receives, waited for by their compute
    outgoing, saved, sends = {}, {}, []
    loss = None
    for a in s.actions[rank]:
        if a.is_comm:
            key = (a.kind.endswith("_F"), a.mb, a.chunk)
            if a.kind.startswith("SEND"):
                tensor = outgoing.pop(key)
                sends.append((tensor, dist.isend(tensor, dst=a.peer)))
            else:
                buf = torch.empty(xs[0].shape, dtype=x.dtype, device=x.device)
                arriving[key] = (buf, dist.irecv(buf, src=a.peer))
            continue
        stage = s.stage(rank, a.chunk)
        needs = (a.kind == "F", a.mb, a.chunk)
        buf = None
        if needs in arriving:      # the receive this compute needs, posted in the group before it
            buf, request = arriving.pop(needs)
            request.wait()
        with timed(a, costs):
            if a.kind == "F":
                inp = xs[a.mb] if stage == 0 else buf.requires_grad_()
                out = chunks[a.chunk](inp)
                if stage == last:
                    out = F.mse_loss(out, ys[a.mb]) / s.m
                    loss = (loss or 0.0) + out.item()
                else:
                    outgoing[(True, a.mb, a.chunk)] = out.detach()
                saved[a.mb, a.chunk] = (inp, out)
            else:
                inp, out = saved.pop((a.mb, a.chunk))
                torch.autograd.backward(out, buf)
                if stage > 0:
                    outgoing[(False, a.mb, a.chunk)] = inp.grad
    for _, request in sends:
        request.wait()
    return loss
''',
        why="no explicit groups: posts each message as it reads it and waits for a receive right before "
            "the compute that needs it (with receives placed as the contract says, the end of its group)",
    ),
    dict(
        name="executor_batch_isend_irecv",
        cell="run_pipeline",
        replace=[("            recvs = []\n", "            ops = []\n"),
                 ("                    pending_sends.append((dist.isend(tensor, dst=a.peer), tensor))",
                  "                    ops.append(dist.P2POp(dist.isend, tensor, a.peer))"),
                 ("                    recvs.append(dist.irecv(received[key], src=a.peer))",
                  "                    ops.append(dist.P2POp(dist.irecv, received[key], a.peer))"),
                 ("            for request in recvs:\n                request.wait()",
                  "            for request in dist.batch_isend_irecv(ops):     # the whole group at once, as on NCCL\n"
                  "                request.wait()")],
        why="posts each group with dist.batch_isend_irecv (a list of P2POp) and waits for all of it, sends included",
    ),
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
