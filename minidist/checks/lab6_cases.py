"""Lab 6's cases, one runner per distributed graded function: this rank's result against full
attention computed in one process (fp64), and the communication it traced against the cost model.

Jacobs et al. 2023 (DeepSpeed-Ulysses, Sec. 3: the all-to-alls and their bytes); Liu et al. 2023
(Ring Attention, Sec. 3: K/V blocks to the next rank only, P−1 passes); Brandon et al. 2023 and
Zhu's ring-flash-attention (zigzag: chunks r and 2P−1−r of 2P); :mod:`minidist.cost.context_parallel`
the bytes. A runner is judged (:class:`minidist.checks.kit.groups.RankRunner`): its ``answer`` runs the
student's function on group rank r of t and returns what it did as plain data (results, traffic,
timings); its ``verdict`` lists the problems from the case and the answer alone, so the grader's
judge gives it again. References are built from torch alone (SDPA and a log-sum-exp in fp64,
:mod:`minidist.checks.lab6_data`): minidist's own context parallelism is refused while these run.
Used by :mod:`minidist.checks.lab6_context_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from minidist import cost
from minidist.checks.kit.docket import digest
from minidist.checks.kit.groups import RankRunner, attempt, raise_verdict
from minidist.checks.lab6_data import (B, D, F32, F64, LATE_S, S, SEQ, compare_all_to_alls, err, H, on_rank, part,
                                       randn, reference_attention, ring_traffic, traffic, unchanged, zigzag_part)
from minidist.runtime.device import device as rank_device
from minidist.runtime.strict_async import blocking_p2p
from minidist.trace import P2P_RECV, P2P_SEND, trace


class FirstCompute(TorchFunctionMode):
    """When this rank first multiplied matrices (``@``, ``matmul``, ``einsum``, SDPA, ...): the start
    of a block's attention, however it is written."""
    OPS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "baddbmm", "einsum", "tensordot",
           "scaled_dot_product_attention"}

    def __init__(self):
        super().__init__()
        self.first = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.first is None and getattr(func, "__name__", "") in self.OPS:
            self.first = time.time()
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- one runner per function
def _a2a_inputs(case, t):
    shape = list(case["local"])
    shape[case["gather"]] *= t
    return shape, randn(shape, 1, case["dtype"]), randn(shape, 2, case["dtype"])


def a2a_answer(fn, case, r, t, group):
    sd, gd = case["scatter"], case["gather"]
    shape, full, up = _a2a_inputs(case, t)
    if case.get("raises"):
        return attempt(fn, (on_rank(part(full, gd, r, t)), sd, gd, group))
    x = on_rank(part(full, gd, r, t)).requires_grad_()
    given = x * 1
    with trace() as tf:
        out = fn(given, sd, gd, group)
    answer = {"given": digest(given), "out": out, "forward": traffic(tf)}
    with trace() as tb:
        (out * on_rank(part(up, sd, r, t))).sum().backward()
    return {**answer, "grad": x.grad, "backward": traffic(tb)}


def a2a_verdict(case, r, t, answer):
    sd, gd = case["scatter"], case["gather"]
    shape, full, up = _a2a_inputs(case, t)
    if case.get("raises"):
        return raise_verdict(answer, f"dim {sd} of size {shape[sd]} does not split into {t} equal chunks")
    errs = [err("the output", answer["out"], part(full, sd, r, t)), err("x.grad", answer["grad"], part(up, gd, r, t)),
            unchanged([answer["given"]], [part(full, gd, r, t)])]
    if t > 1 and not any(errs):
        x = part(full, gd, r, t)
        one = Counter({("all-to-all", x.numel() * x.element_size()): 1})
        errs += [compare_all_to_alls(answer[phase], one, phase) for phase in ("forward", "backward")]
    return errs


def _qkv(case, t):
    h, h_kv, dtype = case.get("h", H), case.get("h_kv", case.get("h", H)), case["dtype"]
    q = randn((B, S, h, D), 10) * case.get("q_scale", 1.0)
    k, v, w = randn((B, S, h_kv, D), 11), randn((B, S, h_kv, D), 12), randn((B, S, h, D), 13)
    return [x.to(dtype).to(F64) for x in (q, k, v, w)], h, h_kv, dtype


def ulysses_answer(fn, case, r, t, group):
    (q, k, v, w), h, h_kv, dtype = _qkv(case, t)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    if case.get("raises") and not (h % t or h_kv % t):
        return {"alone": True}                  # the rank left alone by t = 3: its group of one splits anything
    if case.get("raises"):
        return attempt(fn, tuple(on_rank(cut(x)) for x in (q, k, v)) + (case["causal"], group))
    mine = [on_rank(cut(x)).requires_grad_() for x in (q, k, v)]
    with trace() as tf:
        out = fn(*mine, case["causal"], group)
    answer = {"given": [digest(x) for x in mine], "out": out, "forward": traffic(tf)}
    with trace() as tb:
        (out * on_rank(cut(w))).sum().backward()
    return {**answer, "grads": [x.grad for x in mine], "backward": traffic(tb)}


def ulysses_verdict(case, r, t, answer):
    (q, k, v, w), h, h_kv, dtype = _qkv(case, t)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    if case.get("raises") and not (h % t or h_kv % t):
        return [None]
    if case.get("raises"):
        bad = " and ".join(f"the {c} {n} heads" for n, c in (("query", h), ("kv", h_kv)) if c % t)
        return raise_verdict(answer, f"{bad} do not split over P = {t} ranks")
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*full, case["causal"])
    (ref * w).sum().backward()
    errs = [err("the output", answer["out"], cut(ref.detach()))]
    errs += [err(f"{n}.grad", g, cut(f.grad)) for n, g, f in zip("qkv", answer["grads"], full)]
    errs.append(unchanged(answer["given"], [cut(x) for x in (q, k, v)]))
    if t > 1 and not any(errs):
        want = cost.ulysses_collectives(B, S, h, D, t, h_kv, elem_bytes=torch.empty(0, dtype=dtype).element_size())
        errs += [compare_all_to_alls(answer[phase], Counter(("all-to-all", c.nbytes) for c in want if c.phase == phase),
                                     phase) for phase in ("forward", "backward")]
    return errs


def _overlap_times(r, group, start, first) -> list:
    """The overlap case: group rank 0 started ``LATE_S`` late; [rank 0's start, rank 1's first
    compute], exchanged outside the trace (rank 1 judges them)."""
    times = torch.tensor([start if r == 0 else 0.0, (first or 0.0) if r == 1 else 0.0], dtype=F64,
                         device=rank_device())
    dist.all_reduce(times, group=group)
    return times.tolist()


def _overlap(r, times) -> str | None:
    """Rank 1, which receives its next K/V block from rank 0, must have begun its own block's compute
    before rank 0 even started (so before the late message can land)."""
    late_start, first = times
    if r != 1:
        return None
    if first == 0.0:
        return "no block was computed (no matrix product seen): attend your queries to your own K/V block"
    if first > late_start:
        return (f"with rank 0 (which sends you the next K/V block) starting {LATE_S} s late, your own block's "
                f"compute began only {first - late_start:.2f} s after rank 0 started: the pass must travel while "
                "you compute. Post isend/irecv, compute the block you hold, then wait")
    return None


def _ring_events(tr, group) -> list:
    """[send/recv (or the operation), bytes, the peer's rank in the group (None outside it)] per operation."""
    def in_group(peer):
        if group is None or peer is None:
            return peer
        try:
            return dist.get_group_rank(group, peer)
        except (ValueError, RuntimeError):
            return None
    return [["send" if e.op in P2P_SEND else "recv" if e.op in P2P_RECV else e.op, e.nbytes, in_group(e.peer)]
            for e in tr.comm()]


def ring_answer(fn, case, r, t, group):
    (q, k, v, _), h, h_kv, dtype = _qkv(case, t)
    mine = [on_rank(part(x, SEQ, r, t).to(dtype)) for x in (q, k, v)]
    blocking = blocking_p2p() if case.get("blocking") else contextlib.nullcontext()
    seen = FirstCompute() if case.get("late") else contextlib.nullcontext()
    if case.get("late"):
        dist.barrier(group=group)               # a common start (outside the trace), then rank 0 is late
        if r == 0:
            time.sleep(LATE_S)
    start = time.time()
    with blocking, trace() as tf, seen:
        result = fn(*mine, case["causal"], group)
    late = _overlap_times(r, group, start, seen.first) if case.get("late") else None
    ok = isinstance(result, (tuple, list)) and len(result) == 2
    return {"shape": ok, "out": result[0] if ok else None, "lse": result[1] if ok else None,
            "given": [digest(x) for x in mine], "events": _ring_events(tf, group), "late": late}


def ring_verdict(case, r, t, answer):
    (q, k, v, _), h, h_kv, dtype = _qkv(case, t)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    if not answer["shape"]:
        return ["ring_attention_forward must return (out, lse)"]
    ref, lse = reference_attention(q, k, v, case["causal"])
    lse_dtype = F64 if dtype == F64 else F32                    # the helper's: float32 at least
    errs = [err("the output", answer["out"], cut(ref), dtype=dtype),
            err("the lse", answer["lse"], part(lse, 2, r, t), dtype=lse_dtype),
            unchanged(answer["given"], [cut(x) for x in (q, k, v)]),
            _overlap(r, answer["late"]) if case.get("late") else None]
    if t > 1 and not any(errs):
        elem = torch.empty(0, dtype=dtype).element_size()
        block = cost.ring_attention_messages(B, S, h_kv, D, t, elem_bytes=elem)[0].nbytes
        errs.append(ring_traffic(answer["events"], r, t, block))
    return errs


def _zigzag_input(case):
    shape = case["shape"]
    return torch.arange(torch.Size(shape).numel(), device="cpu").view(shape).to(case["dtype"])


def zigzag_answer(fn, case, r, t, group):
    x = _zigzag_input(case)
    if case["shape"][SEQ] % (2 * t):
        return attempt(fn, (on_rank(x), group))
    given = on_rank(x)
    with trace() as tr:
        out = fn(given, group)
    return {"out": out, "given": digest(given), "traffic": traffic(tr)}


def zigzag_verdict(case, r, t, answer):
    x, seq = _zigzag_input(case), case["shape"][SEQ]
    if seq % (2 * t):
        return raise_verdict(answer, f"a sequence of {seq} does not cut into 2P = {2 * t} chunks")
    errs = [err("the shard", answer["out"], zigzag_part(x, r, t)), unchanged([answer["given"]], [x])]
    if answer["traffic"]:
        ops = ", ".join(f"{k} of {b} B" for k, b in answer["traffic"])
        errs.append(f"zigzag_shard communicated ({ops}): every rank holds the full tensor already")
    return errs


CASE_RUNNERS = {"all_to_all": RankRunner(a2a_answer, a2a_verdict),
                "ulysses_attention": RankRunner(ulysses_answer, ulysses_verdict),
                "ring_attention_forward": RankRunner(ring_answer, ring_verdict),
                "zigzag_shard": RankRunner(zigzag_answer, zigzag_verdict)}
