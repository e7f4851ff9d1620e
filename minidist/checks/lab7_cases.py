"""Lab 7's 3D step, run inside the ranks: the student's ``train_step_3d`` on torch's device mesh,
its losses, weights and traffic by axis next to one process and :mod:`minidist.cost.parallel3d`.

Narayanan et al. 2021 (Megatron-LM, PTD-P), Sec. 3. Every layout of a check shares one
8-rank launch (forking 8 ranks costs more than two steps of the tiny model). Per layout,
every rank builds torch's ``init_device_mesh`` (dims "dp", "pp", "tp"), its
:class:`minidist.mesh.GPTStage` (handed out), SGD with momentum (Adam's update hardly
depends on a gradient's scale, so a gradient not divided by d would slip through), and
calls the student's step ``STEPS`` times with library answers refused, the last step traced.
A rank returns what it did (losses, the last step's trace, digests of the caller's ids and
targets after each step) and its weights' error against one process's cut the same way (the
one comparison made in the rank: the cut needs the rank's groups); :func:`step_failure` judges
the rest from that, in the check and in the grader's judge alike: the losses, the schedule it
ran (the executor's F/B spans, in order) and its traffic by axis. Tensors live on
``minidist.device()`` and the mesh on its device type.
"""
from __future__ import annotations

from collections import Counter

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from minidist.checks.kit.launch import mark_case, one_thread
from minidist.checks.kit.refusal import refusing
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import digest
from minidist.cost.parallel3d import step_collectives
from minidist.harness.parallel3d import TINY, Layout, axis_of
from minidist.memory import model_state_bytes
from minidist.mesh import AXES, GPTStage, coordinate
from minidist.models import TinyGPT, gpt_batch, make_optimizer
from minidist.pipeline import make
from minidist.runtime.device import device as rank_device
from minidist.trace import trace

WORLD = 8
CFG = TINY                      # vocab 32, d_model 16, 4 heads, 4 layers, seq 8
BATCH, STEPS = 8, 2
OPTIMIZER, LR = "sgd", 0.1
SMALL = 16                      # a collective of at most this many bytes is a loss report, in any form
P2P = ("isend", "irecv", "send", "recv")


def _traffic(events, rank: int, layout: Layout) -> dict[str, list[tuple[str, int]]]:
    """This rank's traced step by axis; a group of one rank moves nothing and is left out,
    a group that is none of the rank's mesh groups goes under "other"."""
    out = {a: [] for a in (*AXES, "other")}
    for e in events:
        if e.op == "barrier" or (e.group is not None and len(e.group) == 1):
            continue
        try:
            axis = axis_of(e.group, rank, layout)
        except ValueError:
            axis = "other"
        out[axis].append((e.op, e.nbytes))
    return out


def _large(items) -> list[tuple[str, int]]:
    return sorted((op, n) for op, n in items if op in P2P or n > SMALL)


def traffic_problem(got: dict, layout: Layout, stage: int) -> str | None:
    """None when the traced step matches ``cost.parallel3d.step_collectives``: TP's and PP's
    collectives and messages exactly (kind, bytes), DP's gradient all-reduces in any number of
    calls summing to the stage's gradient bytes (or ZeRO-1's reduce-scatter + all-gather of the
    same bytes); the loss report (collectives of <= 16 bytes) is free in form and group."""
    want = step_collectives(CFG, layout.dp, layout.pp, layout.tp, stage, batch=BATCH,
                            micro_batches=layout.micro_batches)
    want = {a: [(c.op, c.nbytes) for c in want[a]] for a in AXES}
    for axis in ("tp", "pp"):
        g, w = _large(got[axis]), _large(want[axis])
        if g != w:
            extra, missing = Counter(g) - Counter(w), Counter(w) - Counter(g)
            return (f"traffic over the {axis.upper()} group differs from cost.parallel3d: unexpected "
                    f"{sorted(extra.elements()) or 'nothing'}, missing {sorted(missing.elements()) or 'nothing'} "
                    "((op, payload bytes))")
    g, w = _large(got["dp"]), _large(want["dp"])
    grads, ops = sum(n for _, n in w), {op for op, _ in g}
    all_reduced = ops == {"all_reduce"} and sum(n for _, n in g) == grads
    # ZeRO-1 over DP (the lab's going further): reduce-scatter the (padded) flat gradient, all-gather
    # the updated shards; the tracer counts an all-gather's input shard, list form or not
    rs = sum(n for op, n in g if op in ("reduce_scatter_tensor", "reduce_scatter"))
    ag = sum(n for op, n in g if op in ("all_gather_into_tensor", "all_gather"))
    zero1 = (ops <= {"reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather"}
             and grads <= rs <= grads + 4 * (layout.dp - 1) and ag * layout.dp == rs)
    if not (all_reduced or zero1):
        return (f"gradient traffic over the DP group: {sum(n for _, n in g)} bytes in {sorted(Counter(g).items())}; "
                f"expected all-reduces of the stage's {grads} gradient bytes (one flat buffer or one per "
                "parameter), or ZeRO-1's reduce-scatter of them and all-gather of the updated shards")
    if _large(got["other"]):
        return f"collectives over groups that are none of this rank's mesh groups: {_large(got['other'])}"
    return None


def schedule_problem(events, layout: Layout, stage: int) -> str | None:
    """The step must run the schedule it was asked for: the order of the executor's forward and
    backward spans on this stage equals ``make(schedule, pp, m).compute(stage)``'s."""
    got = [(e.op[len("span:"):], e.meta.get("mb")) for e in events if e.op in ("span:F", "span:B")]
    want = [(a.kind, a.mb) for a in make(layout.schedule, layout.pp, layout.micro_batches).compute(stage)]
    if got == want:
        return None
    show = lambda xs: " ".join(f"{k}{mb}" for k, mb in xs) or "nothing"     # noqa: E731
    return (f"the step ran {show(got)} on stage {stage}; the {layout.schedule} schedule it was given runs "
            f"{show(want)} (build it with make(schedule, pp, micro_batches) and run it with run_schedule)")


def _weight_err(stage, ref_state, layout: Layout, i_pp: int, tp_group) -> float:
    ref = TinyGPT(CFG)
    ref.load_state_dict(ref_state)
    expected = GPTStage(ref, i_pp, layout.pp, tp_group)
    return max((p.detach().cpu() - q.detach().cpu()).abs().max().item() for (_, p), (_, q)
               in zip(stage.named_parameters(), expected.named_parameters(), strict=True))


def step_body(progress, fn, name, layouts, ref_state, refusal: Refusal | None, measure: bool = False):
    """Inside a rank: every layout in turn. Returns per layout (losses, weight error, problem or
    None, and with ``measure`` the traffic by axis, model-state bytes and the activation peak)."""
    rank, out = dist.get_rank(), []
    for layout in layouts:
        mark_case(progress, f"layout dp={layout.dp} x pp={layout.pp} x tp={layout.tp}, {layout.schedule}, "
                            f"m={layout.micro_batches}")
        # torch's mesh on this rank's device type ("cuda" on a GPU rank under NCCL, "cpu" under gloo)
        mesh = init_device_mesh(rank_device().type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=AXES)
        i_pp = coordinate(rank, layout.dp, layout.pp, layout.tp)[1]
        tp_group = mesh.get_group("tp")
        stage = GPTStage(TinyGPT(CFG), i_pp, layout.pp, tp_group)
        optimizer = make_optimizer([p for p in stage.parameters() if p.requires_grad], OPTIMIZER, LR)
        losses, peaks, inputs = [], [], []
        with one_thread():
            for step in range(STEPS):
                ids, targets = gpt_batch(step, BATCH, CFG.seq_len, CFG.vocab, device=rank_device())
                with trace() as t, refusing(refusal, name), _activation_peak(fn, peaks if measure else None):
                    loss = fn(stage, optimizer, ids, targets, mesh, layout.micro_batches, layout.schedule)
                losses.append(float(loss) if loss is not None else float("nan"))
                inputs.append([digest(ids), digest(targets)])        # the caller's, as the step left them
        row = {"losses": losses, "weight_err": _weight_err(stage, ref_state, layout, i_pp, tp_group),
               "stage": i_pp, "inputs": inputs, "trace": t}
        if measure:
            row |= {"traffic": _traffic(t.comm(), rank, layout), "activations": peaks[-1] if peaks else None,
                    "model_states": model_state_bytes([p for p in stage.parameters()], optimizer)}
        out.append(row)
    return out


class _activation_peak:
    """With a list: the notebook's ``run_schedule`` (its global name) is wrapped so that its
    ``peak_activation_bytes`` (the executor's ActivationMeter) is recorded; demo runs only."""

    def __init__(self, fn, sink):
        self.sink, self.names = sink, getattr(fn, "__globals__", None)

    def __enter__(self):
        if self.sink is None or self.names is None or "run_schedule" not in self.names:
            self.sink = None
            return self
        self.inner = self.names["run_schedule"]

        def recorded(*args, **kwargs):
            stats = self.inner(*args, **kwargs)
            self.sink.append(stats.peak_activation_bytes)
            return stats
        self.names["run_schedule"] = recorded
        return self

    def __exit__(self, *exc):
        if self.sink is not None:
            self.names["run_schedule"] = self.inner
        return False


def step_failure(name: str, layout: Layout, rank: int, row: dict, ref_losses, tol: float) -> str | None:
    """The first thing wrong with one rank's run of one layout (its row, as plain data), in words:
    its losses against one process's, its weights' error (measured in the rank, against one
    process's weights cut the same way), the caller's ids and targets, the schedule it ran and
    its traffic by axis (from the last step's trace)."""
    where = (f"{name}, layout dp={layout.dp} x pp={layout.pp} x tp={layout.tp} ({layout.schedule}, "
             f"m={layout.micro_batches}), rank {rank} at (dp, pp, tp) = "
             f"{coordinate(rank, layout.dp, layout.pp, layout.tp)}")
    for step, (got, want) in enumerate(zip(row["losses"], ref_losses)):
        if not abs(got - want) <= tol:
            hint = (" (the loss on every rank is the global batch's mean: the last stage's over PP, "
                    "averaged over DP)" if step == 0 else
                    " (step 0 matched: the update differs, i.e. the gradients were reduced over the wrong "
                    "group or scaled wrong)")
            return f"{where}: loss at step {step} is {got:.6f}, one process gets {want:.6f}{hint}"
    if len(row["losses"]) != len(ref_losses):
        return f"{where}: {len(row['losses'])} losses for {len(ref_losses)} steps"
    if not row["weight_err"] <= tol:
        return (f"{where}: after {len(ref_losses)} steps the weights differ from one process's by up to "
                f"{row['weight_err']:.2e} (gradients reduced over the wrong group, or not averaged: "
                "mean over the global batch = sum over DP / d)")
    given = [[digest(x) for x in gpt_batch(step, BATCH, CFG.seq_len, CFG.vocab, device="cpu")]
             for step in range(len(ref_losses))]
    problem = ("the step modified the caller's ids or targets in place (slice or copy them instead)"
               if row["inputs"] != given else schedule_problem(row["trace"].events, layout, row["stage"])
               or traffic_problem(_traffic(row["trace"].comm(), rank, layout), layout, row["stage"]))
    return f"{where}: {problem}" if problem else None
