"""Lab 4 (pipeline parallelism): realistic wrong implementations.

Each bug replaces one solution cell of solutions/lab4_pipeline/lab4_pipeline.ipynb and
names the test cells that must lose points (format: autograder/bugbank/README.md).

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
]

NOT_GRADED = []
RELEASE_MAY_PASS = []
