"""One executor for every schedule: walk this rank's action list, over send/recv.

The schedule decides the order; the executor only knows how to do each action:

* ``F``: run the chunk on the received (or, at stage 0, the input) micro-batch; the
  last stage applies the loss, scaled by 1/m so that the m accumulated micro-batch
  gradients equal the full-batch gradient of a mean loss (micro-batches must
  therefore be equal in size);
* ``B``: backpropagate the received output gradient; parameter gradients accumulate
  in ``.grad`` across micro-batches (zero them yourself before a step, as usual);
* ``BI`` / ``BW`` (zero-bubble, Qi et al. 2023): BI computes only the input gradient
  (``torch.autograd.grad`` w.r.t. the stage input, keeping the graph), BW later the
  weight gradients. Simplification: BW walks the graph again from the output, where
  the paper reuses BI's intermediate gradients, so BW costs more than it should in
  real-compute mode; results are exact either way.

Why it cannot deadlock, under NCCL too: the schedule groups the messages that must
be in flight together (a send and the receive of its neighbour's reply) and the
executor posts each group at once — ``batch_isend_irecv`` on NCCL, isend/irecv
otherwise — and waits only for the group's receives; sends finish in the background
and are waited for at the end. A batch is waited for whole: NCCL returns one work for
it (not one per op), which completes with its last send or receive. The validator proved that order deadlock-free under
rendezvous semantics (:mod:`minidist.pipeline.simulator`) before anything runs. On
gloo, whose ops progress independently, the next group's receives are also posted
early, which only ever lets messages complete sooner.

Sleep-compute mode (``costs=Costs(F=0.02, B=0.04)``): every compute action is padded
with sleep to that wall time. Four ranks on two cores cannot compute in parallel, but
they can sleep in parallel, so measured bubbles then mean what they say.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (see below)
import torch.nn.functional as F

from minidist.memory import ActivationMeter, model_state
from minidist.runtime.device import device as rank_device
from minidist.trace import span
from minidist.pipeline.schedules import Schedule
from minidist.pipeline.simulator import Costs, frees_activation
from minidist.pipeline.validator import check


# ``torch.autograd.backward(out, grad)`` imports this module (and sympy) on its first call
# with an explicit gradient: 0.5-2.5 s of CPU in *every* freshly forked rank. Imported
# here, in the launching process, the ranks inherit it for free.

# Post multi-message groups with batch_isend_irecv on NCCL (one ncclGroup: needed there)
# and plain isend/irecv elsewhere (gloo progresses each op independently). Tests set
# this to True to run the batched path on gloo too.
ALWAYS_BATCH = False
_VALID: set = set()                  # schedules already checked in this process


@contextmanager
def timed(action, costs: Costs | None = None):
    """Wrap one compute action: a trace span (for timelines) and, in sleep-compute mode
    (``costs`` given), padding with sleep up to ``costs.of(action.kind)`` seconds."""
    with span(action.kind, mb=action.mb, chunk=action.chunk):
        start = time.perf_counter()
        yield
        if costs is not None:
            left = start + costs.of(action.kind) - time.perf_counter()
            if left > 0:
                time.sleep(left)


@dataclass
class StepStats:
    loss: float | None          # the full-batch loss, on the rank holding the last stage
    peak_activations: int       # most (micro-batch, chunk) activations held at once
    peak_activation_bytes: int  # most bytes autograd held for backward at once (minidist.memory.ActivationMeter)


def run_schedule(schedule: Schedule, chunks, x=None, y=None, loss_fn=F.mse_loss, *,
                 act_shape=None, group=None, costs: Costs | None = None, dtype=None) -> StepStats:
    """Run one training step's forward and backward of ``schedule`` on this rank.

    ``chunks``: this rank's model chunks (chunk c is stage ``c * p + rank``, see
    :func:`minidist.pipeline.stages.rank_chunks`). ``x``: the full batch, needed on
    the rank holding stage 0; ``y``: targets, needed on the rank holding the last
    stage. ``act_shape``: shape of one micro-batch activation between stages; by
    default that of one input micro-batch (stages that keep the hidden size), which
    needs ``x`` on every rank. ``group``: the pipeline's process group (a mesh
    sub-group); ranks in the schedule are ranks of this group.
    """
    s = schedule
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != s.p:
        raise ValueError(f"schedule is for p={s.p} ranks but the group has {dist.get_world_size(group)}")
    chunks = list(chunks)
    if len(chunks) != s.v:
        raise ValueError(f"schedule gives each rank v={s.v} chunks but rank {rank} was handed {len(chunks)}")
    first, last = 0, s.num_stages - 1
    holds = {s.stage(rank, c) for c in range(s.v)}
    if first in holds and x is None:
        raise ValueError(f"rank {rank} holds stage 0 and needs the input batch x")
    if last in holds and y is None:
        raise ValueError(f"rank {rank} holds the last stage and needs the targets y")
    if x is not None and x.shape[0] % s.m:
        raise ValueError(f"batch of {x.shape[0]} does not split into m={s.m} equal micro-batches "
                         "(the 1/m loss scaling needs equal ones)")
    if act_shape is None:
        if x is None:
            raise ValueError("pass act_shape (one micro-batch activation's shape) or x on every rank")
        act_shape = (x.shape[0] // s.m, *x.shape[1:])
    fingerprint = (s.p, s.m, s.v, tuple(tuple(prog) for prog in s.actions))
    if fingerprint not in _VALID:             # invalid or deadlocking: ValueError, nothing sent yet
        check(s)
        _VALID.add(fingerprint)               # checking costs ms: do it once per schedule, not per step

    param = next((p for c in chunks for p in c.parameters()), None)
    device = param.device if param is not None else x.device if x is not None else rank_device()
    dtype = dtype or (param.dtype if param is not None else torch.float32)
    xs = x.chunk(s.m) if x is not None else None
    ys = y.chunk(s.m) if y is not None else None
    # On a device-mapped group ("cpu:gloo,cuda:nccl") the backend is chosen by the tensors' device:
    # CUDA tensors travel over NCCL, whatever name dist.get_backend() reports for the group.
    nccl = device.type == "cuda"
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))

    received: dict[tuple, torch.Tensor] = {}   # (kind, mb, chunk) -> tensor from a neighbour
    outgoing: dict[tuple, torch.Tensor] = {}   # (kind, mb, chunk) -> tensor for a neighbour
    stored: dict[tuple, tuple] = {}            # (mb, chunk) -> (stage input, stage output or loss)
    out_grad: dict[tuple, torch.Tensor | None] = {}   # kept from BI for BW
    pending_sends, loss_sum = [], None
    peak = 0
    meter = ActivationMeter([q for c in chunks for q in model_state(c)])     # weights are not activations

    prog = s.actions[rank]
    groups = []                         # (first, end) of each run of communication actions
    for i, a in enumerate(prog):
        if a.is_comm and (i == 0 or not prog[i - 1].is_comm):
            groups.append([i, i + 1])
        elif a.is_comm:
            groups[-1][1] = i + 1
    # gloo moves a message only once its receive is posted (a handshake), so a receive
    # posted just before it is needed costs a round trip even if the data was sent long
    # ago. Off NCCL we therefore post the *next* group's receives early. Not on NCCL: an
    # early receive would sit on the pair's stream ahead of our own sends there.
    prefetch = not (nccl or ALWAYS_BATCH)
    early: dict[tuple, object] = {}     # (kind, mb, chunk) -> Work of a receive already posted

    def key_of(a):                      # which tensor a communication action moves
        return ("act" if a.kind.endswith("_F") else "grad", a.mb, a.chunk)

    def buffer(a):
        received[key_of(a)] = torch.empty(act_shape, device=device, dtype=dtype)
        return received[key_of(a)]

    def post(g):
        actions = prog[slice(*groups[g])]
        ops = [(dist.isend, outgoing.pop(key_of(a)), a.peer) if a.kind.startswith("SEND")
               else (dist.irecv, buffer(a), a.peer) for a in actions if key_of(a) not in early]
        recvs = [early.pop(key_of(a)) for a in actions if key_of(a) in early]
        if (nccl or ALWAYS_BATCH) and len(ops) > 1:   # one group: the pair cannot block each other
            # One work per op on gloo, one for the whole group on NCCL: which is which is unknown,
            # so all of them are waited for before the next compute (on NCCL that is the only choice).
            recvs += dist.batch_isend_irecv([dist.P2POp(op, t, peer(q), group) for op, t, q in ops])
        else:
            for op, t, q in ops:        # isend/irecv: exactly one work each
                w = op(t, peer(q), group=group)
                (pending_sends.append((w, t)) if op is dist.isend else recvs.append(w))
        if prefetch and g + 1 < len(groups):
            for a in prog[slice(*groups[g + 1])]:
                if a.kind.startswith("RECV"):
                    early[key_of(a)] = dist.irecv(buffer(a), peer(a.peer), group=group)
        for w in recvs:                 # the next compute needs these; sends may drain later
            w.wait()

    def pad(start, kind):
        if costs is not None:
            left = start + costs.of(kind) - time.perf_counter()
            if left > 0:
                time.sleep(left)

    i, g = 0, 0
    while i < len(prog):
        if prog[i].is_comm:
            post(g)
            i, g = groups[g][1], g + 1
            continue
        a, i = prog[i], i + 1
        key, stage, module = (a.mb, a.chunk), s.stage(rank, a.chunk), chunks[a.chunk]
        with span(a.kind, mb=a.mb, chunk=a.chunk, stage=stage):
            start = time.perf_counter()
            if a.kind == "F":
                inp = xs[a.mb] if stage == first else received.pop(("act", *key)).requires_grad_()
                with meter.recording():
                    out = module(inp)
                    if stage == last:
                        out = loss_fn(out, ys[a.mb]) / s.m
                        loss_sum = out.detach() if loss_sum is None else loss_sum + out.detach()
                if stage != last:
                    outgoing[("act", *key)] = out.detach()
                stored[key] = (inp, out)
                peak = max(peak, len(stored))
            else:
                inp, out = stored[key]
                grad = None if stage == last or a.kind == "BW" else received.pop(("grad", *key))
                if a.kind == "B":
                    torch.autograd.backward(out, grad)
                    if stage != first:
                        outgoing[("grad", *key)] = inp.grad
                elif a.kind == "BI":
                    out_grad[key] = grad
                    if stage != first:   # stage 0's input needs no gradient: BW does it all
                        (gin,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
                        outgoing[("grad", *key)] = gin
                else:  # BW
                    params = [p for p in module.parameters() if p.requires_grad]
                    grads = torch.autograd.grad(out, params, out_grad.pop(key), allow_unused=True)
                    for p_, wg in zip(params, grads):
                        if wg is not None:
                            p_.grad = wg if p_.grad is None else p_.grad + wg
                if frees_activation(a.kind):
                    del stored[key]
            pad(start, a.kind)
    for w, _ in pending_sends:          # the tensors stay referenced until their send is done
        w.wait()
    return StepStats(None if loss_sum is None else float(loss_sum), peak, meter.peak_bytes)
