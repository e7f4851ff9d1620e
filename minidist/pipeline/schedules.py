"""Pipeline schedules as data: per rank, an ordered list of actions.

A schedule says *what* each rank does and in which order; it does not run anything.
One executor (:mod:`minidist.pipeline.executor`) runs any valid schedule, one
simulator (:mod:`minidist.pipeline.simulator`) times it, one validator
(:mod:`minidist.pipeline.validator`) checks it. This is the design of
``torch.distributed.pipelining`` (schedules lowered to per-rank action lists), in
miniature.

Actions
    ``F(mb, chunk)``      forward of micro-batch ``mb`` through this rank's model chunk
    ``B(mb, chunk)``      full backward (input grad and weight grad)
    ``BI`` / ``BW``       backward split for zero-bubble schedules (Qi et al., 2023):
                          BI = grad w.r.t. the stage input (on the critical path),
                          BW = grad w.r.t. the weights (can wait, fills bubbles)
    ``SEND_F`` / ``RECV_F``  the activation of (mb, chunk) to / from the next / previous stage
    ``SEND_B`` / ``RECV_B``  the input gradient of (mb, chunk) to / from the previous / next stage

Communication semantics (the contract between the three tools): a *run of
consecutive communication actions* is one batch; the executor posts the whole batch
(isend/irecv, or ``batch_isend_irecv`` on NCCL) and waits for all of it before the
next compute action. Messages between two ranks match in order (FIFO per direction,
no tags), which is what NCCL does.

Stages: with ``v`` chunks per rank there are ``S = p * v`` stages and rank ``r``
holds stages ``r, r + p, r + 2p, ...`` (Megatron-LM's interleaving, Narayanan et al.
2021), so chunk ``c`` of rank ``r`` is stage ``c * p + r``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE = ("F", "B", "BI", "BW")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    kind: str               # one of COMPUTE + COMM
    mb: int                 # micro-batch index
    chunk: int = 0          # model chunk on this rank (0 unless interleaved)
    peer: int | None = None  # the other rank, for communication actions

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM

    def __str__(self) -> str:
        c = f"c{self.chunk}" if self.chunk else ""
        if self.is_comm:
            arrow = "->" if self.kind.startswith("SEND") else "<-"
            return f"{self.kind}{self.mb}{c}{arrow}{self.peer}"
        return f"{self.kind}{self.mb}{c}"

    __repr__ = __str__


@dataclass
class Schedule:
    """``actions[r]`` is rank ``r``'s program; ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank."""
    name: str
    p: int
    m: int
    v: int = 1
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding ``stage``."""
        return stage % self.p, stage // self.p

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if not a.is_comm]

    def __str__(self) -> str:
        rows = [f"{self.name} (p={self.p}, m={self.m}, v={self.v})"]
        rows += [f"  rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join(rows)


def _check_pm(p: int, m: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p (pipeline ranks) must be a positive integer, got {p!r}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"m (micro-batches) must be a positive integer, got {m!r}")


def with_comms(name: str, p: int, m: int, v: int, order: list[list]) -> Schedule:
    """Insert the sends and receives that per-rank compute orders need.

    ``order[r]`` lists rank r's compute actions; an entry may also be a tuple of
    actions run back to back as one *step*. The receives a step needs go right before
    it, the sends it produces right after it. A step's sends are therefore
    consecutive with the next step's receives and land in one group: 1F1B's "send
    activation of mb k, receive gradient of mb j" is posted as a pair, as Megatron-LM
    does with ``send_forward_recv_backward``. Posted one after the other with
    blocking calls they would deadlock under NCCL (both neighbours stuck in send).
    """
    sched = Schedule(name, p, m, v)
    last = p * v - 1
    for r, steps in enumerate(order):
        prog: list[Action] = []
        for step in steps:
            step = step if isinstance(step, tuple) else (step,)
            for a in step:
                s = sched.stage(r, a.chunk)
                if a.kind == "F" and s > 0:
                    prog.append(Action("RECV_F", a.mb, a.chunk, (s - 1) % p))
                if a.kind in ("B", "BI") and s < last:
                    prog.append(Action("RECV_B", a.mb, a.chunk, (s + 1) % p))
            prog.extend(step)
            for a in step:
                s = sched.stage(r, a.chunk)
                if a.kind == "F" and s < last:
                    prog.append(Action("SEND_F", a.mb, a.chunk, (s + 1) % p))
                if a.kind in ("B", "BI") and s > 0:
                    prog.append(Action("SEND_B", a.mb, a.chunk, (s - 1) % p))
        sched.actions.append(prog)
    return sched


def naive(p: int, m: int = 1) -> Schedule:
    """Naive model parallelism: the whole batch goes through stage 0, 1, ... and back.

    Only one rank works at a time: utilisation 1/p, bubble (p-1)/p.
    """
    _check_pm(p, m)
    if m != 1:
        raise ValueError(f"naive model parallelism runs the whole batch at once (m=1), got m={m}; "
                         "split into micro-batches with gpipe() or one_f_one_b()")
    return with_comms("naive", p, 1, 1, [[Action("F", 0), Action("B", 0)] for _ in range(p)])


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al., 2019): all m forwards, then all m backwards.

    Bubble (p-1)/(m+p-1); every rank holds m micro-batches' activations at the peak.
    """
    _check_pm(p, m)
    order = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return with_comms("gpipe", p, m, 1, order)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): same bubble as GPipe, less memory.

    Rank r runs warmup = min(p - r - 1, m) forwards, then alternates one forward and
    one backward, then drains the remaining backwards. A backward frees its
    micro-batch, so rank r holds at most warmup + 1 <= p - r activations (GPipe: m).
    """
    _check_pm(p, m)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):          # steady state: F(i + warmup), B(i)
            acts += [Action("F", i + warmup), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warmup, m)]
        order.append(acts)
    return with_comms("1f1b", p, m, 1, order)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021, sec. 2.2): v model chunks per rank.

    Each rank holds v non-adjacent stages; a micro-batch visits every rank v times,
    so the pipeline fills v times faster: bubble (p-1)/(v*m + p-1) of wall time, i.e.
    (1/v)·(p-1)/m relative to compute, paid for with v times more messages.

    Constraint: micro-batches move through the chunks in groups of p (rank r runs
    chunk 0 for micro-batches 0..p-1, then chunk 1 for the same group, ...), so
    m must be a multiple of p. Also p >= 2 and v >= 2 (v = 1 is plain 1F1B).
    """
    _check_pm(p, m)
    if p < 2:
        raise ValueError(f"interleaved 1F1B needs p >= 2 ranks, got p={p}")
    if not isinstance(v, int) or v < 2:
        raise ValueError(f"interleaved 1F1B needs v >= 2 chunks per rank (v=1 is one_f_one_b), got v={v}")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m to be a multiple of p (micro-batches go through "
                         f"the chunks in groups of p); got m={m}, p={p}")
    total = m * v        # (micro-batch, chunk) units per rank

    def unit(k: int, forward: bool) -> tuple[int, int]:
        """k-th forward (or backward) unit of a rank -> (micro-batch, chunk)."""
        group, within = divmod(k, p * v)
        chunk = within // p
        if not forward:                      # backwards visit the chunks last-to-first
            chunk = v - 1 - chunk
        return group * p + within % p, chunk

    order = []
    for r in range(p):
        # Megatron-LM's warmup: enough forwards that the first backward's gradient
        # has had time to come back through the later stages.
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [Action("F", *unit(k, True)) for k in range(warmup)]
        for k in range(total - warmup):
            # One step: the forward and backward share one group of messages before and
            # after (Megatron-LM's send_forward_backward_recv_forward_backward); with
            # separate groups, p = 2 deadlocks, because both neighbours are the same rank.
            acts.append((Action("F", *unit(k + warmup, True)), Action("B", *unit(k, False))))
        acts += [Action("B", *unit(k, False)) for k in range(total - warmup, total)]
        order.append(acts)
    return with_comms(f"interleaved(v={v})", p, m, v, order)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1).

    The backward is split into BI (input gradient, needed upstream now) and BW
    (weight gradient, needed only by the optimizer). The order is 1F1B with B -> BI,
    and rank r postpones each BW by r steps, so its last r weight gradients fill the
    cool-down bubble. Rank r holds (p - r) + r = p micro-batches at the peak, the
    same as 1F1B's rank 0. With t_F = t_BI = t_BW the bubble shrinks from
    (p-1)(t_F + t_B) to (p-1)(t_F + t_BI - t_BW): a third.
    """
    _check_pm(p, m)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        w_next = 0                            # next micro-batch whose BW is due

        def w_upto(j):                        # emit the BWs for micro-batches < j
            nonlocal w_next
            while w_next < j:
                acts.append(Action("BW", w_next))
                w_next += 1

        for i in range(m - warmup):
            acts += [Action("F", i + warmup), Action("BI", i)]
            w_upto(i + 1 - r)
        for i in range(m - warmup, m):
            acts.append(Action("BI", i))
            w_upto(i + 1 - r)
        w_upto(m)
        order.append(acts)
    return with_comms("zb-h1", p, m, 1, order)


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b,
             "interleaved": interleaved_1f1b, "zb-h1": zb_h1}


def make(name: str, p: int, m: int, **kw) -> Schedule:
    """A schedule by name: ``make("1f1b", p=4, m=8)``, ``make("interleaved", 4, 8, v=2)``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m, **kw)
