"""Time a schedule without running it: timeline, bubble fraction, peak activations.

Each rank walks its action list; compute actions take their cost from
:class:`Costs`. Communication is modelled on NCCL, the strictest backend:

* a run of consecutive communication actions is one *group*, posted at once (as
  ``batch_isend_irecv`` does); the rank then waits for the group's receives only,
  because the next compute needs that data, while its sends drain in the background;
* messages between ranks a and b travel on one stream per pair, so a group's part
  on that stream starts only after the previous group's part there finished;
* a message completes when both its send and its receive have started (rendezvous:
  NCCL may hold a send until the receive exists), plus ``Costs.comm``;
* a rank finishes when its program ends and its last sends have drained.

A schedule that completes under this model also completes under gloo (which only
buffers more). One that cannot is reported as a deadlock, a :class:`ScheduleError`
naming what every stuck rank waits for, instead of looping.

Bubble fraction = 1 - (busy time summed over ranks) / (p * makespan): the share of
rank-time spent idle. For GPipe and 1F1B it is (p-1)/(m+p-1) for any t_F, t_B
(see :func:`minidist.cost.pipeline_bubble`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from minidist.pipeline.schedules import Schedule
from minidist.pipeline.structure import ScheduleError, structural_problems


@dataclass
class Costs:
    """Time of one action on one chunk. Default: t_F = 1, t_B = 2 (a backward is two
    matmuls per forward matmul), split evenly into BI and BW for zero-bubble."""
    F: float = 1.0
    B: float = 2.0
    BI: float | None = None
    BW: float | None = None
    comm: float = 0.0

    def of(self, kind: str) -> float:
        if kind in ("BI", "BW"):
            own = getattr(self, kind)
            return self.B / 2 if own is None else own
        return getattr(self, kind)


@dataclass
class Slot:
    """One compute action on the timeline (simulated or measured)."""
    rank: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float


@dataclass
class SimResult:
    schedule: Schedule
    timeline: list[Slot]
    makespan: float
    busy: list[float]               # compute time per rank
    peak_activations: list[int]     # max (micro-batch, chunk) activations held, per rank

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.busy, self.makespan)


def bubble_fraction(busy: list[float], makespan: float) -> float:
    return 1.0 - sum(busy) / (len(busy) * makespan) if makespan > 0 else 0.0


def frees_activation(kind: str) -> bool:
    """The action after which a micro-batch's stored activations can be dropped."""
    return kind in ("B", "BW")


def simulate(s: Schedule, costs: Costs | None = None, check: bool = True) -> SimResult:
    """Run ``s`` on paper. Raises ScheduleError if it is invalid or deadlocks."""
    costs = costs or Costs()
    if check:
        problems = structural_problems(s)
        if problems:
            raise ScheduleError(f"invalid schedule {s.name}: " + "; ".join(problems[:5]))
    p = s.p
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    live, peak = [0] * p, [0] * p
    timeline: list[Slot] = []
    # Every message is (src, dst, k): the k-th one on that channel. For each side we
    # remember which stream unit carries it; a unit is one group's ops on one pair stream.
    n_msgs: dict[tuple, int] = defaultdict(int)
    carrier: dict[tuple, tuple] = {}            # (src, dst, k, side) -> unit id
    units: dict[tuple, list[dict]] = defaultdict(list)   # (rank, peer) -> units in order
    waiting: list[list | None] = [None] * p     # receives (unit id, msg) a rank is blocked on
    state = ["run"] * p                         # run -> wait -> ... -> drain -> done

    def post(r: int, first: int, end: int) -> list:
        mine: dict[int, dict] = {}
        recvs = []
        for a in s.actions[r][first:end]:
            send = a.kind.startswith("SEND")
            src, dst = (r, a.peer) if send else (a.peer, r)
            msg = (src, dst, n_msgs[(src, dst, send)])
            n_msgs[(src, dst, send)] += 1
            if a.peer not in mine:
                mine[a.peer] = {"post": clock[r], "start": None, "done": None, "msgs": [], "what": []}
                units[(r, a.peer)].append(mine[a.peer])
            unit = (r, a.peer, len(units[(r, a.peer)]) - 1)
            mine[a.peer]["msgs"].append((msg, "send" if send else "recv"))
            mine[a.peer]["what"].append(str(a))
            carrier[msg + ("send" if send else "recv",)] = unit
            if not send:
                recvs.append((unit, msg))
        return recvs

    def unit_of(key):
        r, q, j = key
        return units[(r, q)][j]

    finished = 0
    while finished < p:
        progress = False
        for r in range(p):                      # hosts: compute, post groups, wait for receives
            prog = s.actions[r]
            if state[r] == "wait":
                done = [unit_of(u)["done_msgs"].get(msg) for u, msg in waiting[r]
                        if "done_msgs" in unit_of(u)]
                if len(done) < len(waiting[r]) or None in done:
                    continue
                clock[r] = max([clock[r], *done])
                state[r], progress = "run", True
            if state[r] == "run":
                while pc[r] < len(prog) and not prog[pc[r]].is_comm:
                    a = prog[pc[r]]
                    t = costs.of(a.kind)
                    timeline.append(Slot(r, a.kind, a.mb, a.chunk, clock[r], clock[r] + t))
                    clock[r] += t
                    busy[r] += t
                    if a.kind == "F":
                        live[r] += 1
                        peak[r] = max(peak[r], live[r])
                    elif frees_activation(a.kind):
                        live[r] -= 1
                    pc[r] += 1
                progress = True
                if pc[r] == len(prog):
                    state[r] = "drain"
                else:
                    end = pc[r]
                    while end < len(prog) and prog[end].is_comm:
                        end += 1
                    waiting[r] = post(r, pc[r], end)
                    pc[r] = end
                    state[r] = "wait"
            if state[r] == "drain" and all(u["done"] is not None for q in range(p) for u in units[(r, q)]):
                clock[r] = max([clock[r]] + [u["done"] for q in range(p) for u in units[(r, q)]])
                state[r], finished, progress = "done", finished + 1, True
        for (r, q), stream in units.items():    # pair streams: one unit at a time, in order
            for j, u in enumerate(stream):
                if u["done"] is not None:
                    continue
                if u["start"] is None:
                    u["start"] = max(u["post"], stream[j - 1]["done"]) if j else u["post"]
                    u["done_msgs"] = {}
                    progress = True
                for msg, side in u["msgs"]:
                    where = carrier.get(msg + ("recv" if side == "send" else "send",))   # not posted yet: None
                    other = unit_of(where) if where else None
                    if other is not None and other["start"] is not None and msg not in u["done_msgs"]:
                        u["done_msgs"][msg] = max(u["start"], other["start"]) + costs.comm
                        progress = True
                if len(u["done_msgs"]) == len(u["msgs"]):
                    u["done"] = max(u["done_msgs"].values())
                    progress = True
                break                           # later units wait for this one
        if not progress:
            raise ScheduleError(f"schedule {s.name} (p={s.p}, m={s.m}) deadlocks: " + "; ".join(_stuck(s, state, units)))
    return SimResult(s, timeline, max(clock) if p else 0.0, busy, peak)


def _stuck(s: Schedule, state: list[str], units) -> list[str]:
    out = []
    for r in range(s.p):
        if state[r] == "done":
            continue
        heads = [f"{{{', '.join(u['what'])}}}" for q in range(s.p) for u in units[(r, q)]
                 if u["done"] is None and u.get("start") is not None]
        verb = "waits for its receives" if state[r] == "wait" else "cannot drain its sends"
        out.append(f"rank {r} {verb}; unmatched on its streams: {', '.join(heads) or '-'}")
    return out
