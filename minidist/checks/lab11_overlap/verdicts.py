"""Lab 11's verdicts: what is wrong with an answer, from the case alone.

Three things, in this order: the **result** (equal to one process's, :mod:`cases`), the **schedule**
read from the trace (the communication a computation hides is posted before that computation starts
and waited for only after it started, tested from the recorded times, not from the code) and the
**bytes** (one shard per unit or per ring step, to the ring's neighbours). ``exposed_time`` is judged
against :func:`minidist.trace.timeline.exposed` on the same events.
"""
from __future__ import annotations

import math

from minidist.checks.kit.compare import first, tensor_error
from minidist.checks.lab11_overlap.cases import F32, ag_reference, ag_shards, prefetch_reference, rs_reference, \
    unit_weights
from minidist.trace.events import Event, Trace
from minidist.trace.timeline import exposed

GATHERS = {"all_gather_into_tensor", "all_gather", "all_gather_single"}
OP, PEER, NBYTES, START, ISSUED, WAITED, END = range(7)


def _size(case, shape) -> int:
    return math.prod(shape) * {"torch.float64": 8, "torch.bfloat16": 2}.get(str(case.get("dtype", F32)), 4)


def _overlaps(what: str, event, during, doing: str) -> str | None:
    """Whether communication ``event`` was in flight while ``during`` (chunk or unit, start, end) computed:
    posted (asynchronously) before it started, waited for after it started."""
    if event[ISSUED] is None:
        return (f"{what} is a blocking call ({event[OP]}): nothing computes while it travels; post it with "
                f"async_op=True / isend / irecv and wait() after the computation")
    if event[START] >= during[1]:
        return (f"{what} was posted after {doing} began: post it before, so that it travels while {doing} "
                f"computes")
    if event[WAITED] is None:
        return f"{what} was never waited for: call wait() on its work before you use (or reuse) its buffer"
    if event[WAITED] < during[1]:
        return (f"{what} was waited for before {doing} began: the wait blocks until the bytes arrive, so nothing "
                f"overlapped; wait after the computation")
    return None


def _result(answer, want, t) -> str | None:
    return tensor_error("the output", answer["out"], want, against="one process", factors={"t, the group's size": t})


# ----------------------------------------------------------------------------- prefetch_forward
def prefetch(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    if problem := _result(answer, prefetch_reference(case), t):
        return problem
    units, computed = case["units"], answer["computed"]
    if [c[0] for c in computed] != list(range(units)):
        return (f"layer was called for units {[c[0] for c in computed]}; expected each unit once, in order: "
                f"{list(range(units))}")
    if t == 1:
        return None
    gathers = sorted((e for e in answer["comm"] if e[OP] in GATHERS), key=lambda e: e[START])
    others = sorted({e[OP] for e in answer["comm"] if e[OP] not in GATHERS})
    if others:
        return (f"communicated with {', '.join(others)}: a unit's weight is gathered with one all-gather of "
                f"this rank's shard (dist.all_gather_into_tensor)")
    if len(gathers) != units:
        return f"{len(gathers)} all-gathers for {units} units: gather each unit's weight exactly once"
    shard = _size(case, unit_weights(case)[0].tensor_split(t, 0)[r].shape)
    if bad := [e[NBYTES] for e in gathers if e[NBYTES] != shard]:
        return f"an all-gather sent {bad[0]} B; this rank's shard of a unit's weight is {shard} B"
    for i in range(units - 1):
        if problem := _overlaps(f"unit {i + 1}'s all-gather", gathers[i + 1], computed[i], f"unit {i}"):
            return problem
    for i in range(units - 2):
        if gathers[i + 2][START] < computed[i][2]:
            return (f"unit {i + 2}'s all-gather was posted before unit {i} finished: three units' full weights "
                    f"are held at once; prefetch one unit ahead, no more (the memory FSDP's prefetch costs is "
                    f"one extra unit)")
    return None


# ----------------------------------------------------------------------------- the two rings
def _ring(answer, r: int, t: int, start: int, message: int, kind: str) -> str | None:
    """The sends and receives of a ring: t - 1 of ``message`` bytes each, every send to one neighbour and
    every receive from the other, point-to-point only. ``start``: the group's first global rank."""
    others = sorted({e[OP] for e in answer["comm"] if e[OP] not in ("isend", "irecv")})
    if others:
        blocking = set(others) & {"send", "recv"}
        return (f"communicated with {', '.join(others)}: "
                + ("a blocking send/recv leaves nothing to overlap: post isend/irecv (or batch_isend_irecv), "
                   "compute, then wait" if blocking else f"the ring is t - 1 point-to-point steps of one {kind} "
                                                         f"each (isend/irecv), not a collective"))
    sends = sorted((e for e in answer["comm"] if e[OP] == "isend"), key=lambda e: e[START])
    recvs = sorted((e for e in answer["comm"] if e[OP] == "irecv"), key=lambda e: e[START])
    if len(sends) != t - 1 or len(recvs) != t - 1:
        return f"{len(sends)} sends and {len(recvs)} receives; a ring of {t} ranks takes {t - 1} of each"
    if bad := [e[NBYTES] for e in sends + recvs if e[NBYTES] != message]:
        return f"a message of {bad[0]} B; each ring step moves one {kind} of {message} B"
    to = {(e[PEER] - start) for e in sends}
    frm = {(e[PEER] - start) for e in recvs}
    right, left = (r + 1) % t, (r - 1) % t
    if not ((to == {right} and frm == {left}) or (to == {left} and frm == {right})):
        return (f"rank {r} sent to group ranks {sorted(to)} and received from {sorted(frm)}; on a ring every "
                f"step sends to one neighbour ({right} or {left}) and receives from the other")
    return None


def _calls(answer, t: int) -> str | None:
    chunks = [c[0] for c in answer["computed"]]
    if len(chunks) != t or sorted(chunks) != list(range(t)):
        return (f"mm was called on chunks {['not a whole chunk' if c < 0 else c for c in chunks]}; the ring calls "
                f"it once per chunk, on each of the {t} chunks")
    return None


def _hidden_behind(answer, t: int, first_step: int, sent: str) -> str | None:
    """Each of the t-1 messages is posted before the matmul it hides and waited for after it: the
    ring all-gather hides step s's message behind step s's matmul (``first_step=0``), the
    reduce-scatter hides it behind the next one's (``first_step=1``: the accumulator travels after
    its first partial product)."""
    sends, recvs = ([e for e in sorted(answer["comm"], key=lambda e: e[START]) if e[OP] == op]
                    for op in ("isend", "irecv"))
    computed = answer["computed"]
    for k in range(t - 1):
        s = k + first_step
        doing = f"the matmul of step {s} (chunk {computed[s][0]})"
        if problem := first([_overlaps(f"step {s}'s {sent}", sends[k], computed[s], doing),
                             _overlaps(f"step {s}'s receive", recvs[k], computed[s], doing)]):
            return problem
    return None


def ag_matmul(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    if problem := _result(answer, ag_reference(case, t), t):
        return problem
    if t == 1:
        return None
    shard = _size(case, ag_shards(case, t)[r].shape)
    if problem := first([_ring(answer, r, t, item.rank - r, shard, "shard"), _calls(answer, t)]):
        return problem
    return _hidden_behind(answer, t, first_step=0, sent="send")


def rs_matmul(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    if problem := _result(answer, rs_reference(case, r, t), t):
        return problem
    if t == 1:
        return None
    chunk = _size(case, (case["n"], case["m"]))
    if problem := first([_ring(answer, r, t, item.rank - r, chunk, "output chunk"), _calls(answer, t)]):
        return problem
    return _hidden_behind(answer, t, first_step=1, sent="send of the accumulator")


# ----------------------------------------------------------------------------- exposed_time
def exposed_verdict(case, answer) -> str | None:
    want = exposed(Trace(Event(**e) for e in case["events"]), case["rank"])
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"exposed_time returned {type(answer).__name__}; expected a number of seconds"
    if not abs(answer - want) <= 1e-9 * max(1.0, abs(want)):
        return (f"exposed_time(events, rank={case['rank']}) returned {answer:.6g} s; the rank waited on "
                f"communication for {want:.6g} s (the union of its waits)")
    return None


VERDICT = {"prefetch_forward": prefetch, "all_gather_matmul": ag_matmul, "matmul_reduce_scatter": rs_matmul}
