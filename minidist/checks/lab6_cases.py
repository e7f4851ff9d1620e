"""Lab 6's cases, one runner per distributed graded function: this rank's result against full
attention computed in one process (fp64), and the communication it traced against the cost model.

Jacobs et al. 2023 (DeepSpeed-Ulysses, Sec. 3: the all-to-alls and their bytes); Liu et al. 2023
(Ring Attention, Sec. 3: K/V blocks to the next rank only, P−1 passes); Brandon et al. 2023 and
Zhu's ring-flash-attention (zigzag: chunks r and 2P−1−r of 2P); :mod:`minidist.cost.context_parallel`
the bytes. A runner takes (fn, case, group rank r, group size t, group) and returns a list of
problems (None where all is well). References are built from torch alone (SDPA and a log-sum-exp
in fp64): minidist's own context parallelism is refused while these run.
Used by :mod:`minidist.checks.lab6_context_parallel`, which launches, stands in and reports.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from minidist import cost
from minidist.checks.common import TOL
from minidist.checks.returned import not_plain_tensor
from minidist.runtime.device import device as rank_device
from minidist.runtime.strict_async import blocking_p2p
from minidist.trace import P2P_RECV, P2P_SEND, trace

WORLD, B, S, H, D = 4, 2, 24, 12, 4     # S divisible by 2P for P = 1..4; H by 1..4
SEQ, HEADS = 1, 2                       # (batch, seq, heads, head_dim)
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
LATE_S = 0.6                            # the late peer of the overlap case starts this much after the others
# Relative tolerances by dtype: fp32 vs fp64 within TOL; fp64 computed in fp64 (a merge or ring that
# rounds fp64 through fp32 is off by ~1e-7); bf16 outputs rounded once (2^-8) after an fp32 computation.
TOLS = {F64: 1e-9, BF16: 2e-2}


def tol(dtype) -> float:
    return TOLS.get(dtype, TOL)


# ----------------------------------------------------------------------------- data, references
def randn(shape, seed, dtype=F64) -> torch.Tensor:
    """Drawn on the CPU (references are computed there), the same numbers on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64, device="cpu").to(dtype)


def on_rank(x: torch.Tensor) -> torch.Tensor:
    """A CPU-built input moved to this rank's device (``minidist.device()``): the student's code sees it there."""
    return x.to(rank_device())


def part(x, dim, r, t):
    return x.tensor_split(t, dim=dim)[r]


def zigzag_part(x, r, t, dim=SEQ):
    """Chunks r and 2t−1−r of 2t along ``dim``."""
    chunks = x.tensor_split(2 * t, dim=dim)
    return torch.cat([chunks[r], chunks[2 * t - 1 - r]], dim=dim)


def reference_attention(q, k, v, causal):
    """Full attention in fp64 on (b, s, h, d) leaves: (out, lse (b, h, s)); q, k, v get .grad."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True).transpose(1, 2)
    with torch.no_grad():
        kr = kh.repeat_interleave(q.size(2) // k.size(2), dim=1)        # query head i reads kv head i·h_kv/h
        s = qh @ kr.transpose(-2, -1) / math.sqrt(q.size(-1))
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
    return out, lse


def err(what, got, want, slack: float = 0.0, dtype=None) -> str | None:
    """Why ``got`` is not ``want`` (None if it is, within ``tol(dtype)`` relative to its scale, +
    ``slack``), compared on the CPU. ``dtype``: the dtype ``got`` must have exactly (default: ``want``'s)."""
    if got is None:
        return f"{what} is None: no gradient reached it (was it detached, or built outside autograd?)"
    if problem := not_plain_tensor(what, got, want.shape):
        return problem
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    dtype = dtype or want.dtype
    if got.dtype != dtype:
        return f"{what} has dtype {got.dtype}, expected {dtype} exactly"
    got, want = got.detach().cpu(), want.detach().cpu()
    if not dtype.is_floating_point:
        return None if torch.equal(got, want.to(dtype)) else f"{what} holds other elements than expected"
    got, want = got.to(F64), want.to(F64)
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= tol(dtype) * scale + slack:           # NaN fails too
        return f"{what} differs from one process (max |error| {diff:.3g}, scale {scale:.3g})"
    return None


# ----------------------------------------------------------------------------- traffic
FAMILY = {"all_to_all_single": "all-to-all", "all_to_all": "all-to-all"}


def traffic(tr) -> Counter:
    return Counter((FAMILY.get(e.op, e.op), e.nbytes) for e in tr.comm())


def show(c: Counter) -> str:
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def compare_all_to_alls(got: Counter, want: Counter, phase: str) -> str | None:
    """Equal multisets, or (qkv packed into fewer calls) only all-to-alls with the same total bytes."""
    total = lambda c: sum(b * n for (_, b), n in c.items())        # noqa: E731
    if got == want or ({k for k, _ in got} == {"all-to-all"} and total(got) == total(want)):
        return None
    return f"{phase} communicated {show(got)}; expected {show(want)}"


def ring_traffic(tr, r, t, group, block_bytes) -> str | None:
    """K/V go to the next rank only, come from the previous only: P−1 blocks (k and v together or apart)."""
    to_global = (lambda g: g) if group is None else (lambda g: dist.get_global_rank(group, g))
    nxt, prv = to_global((r + 1) % t), to_global((r - 1) % t)
    events = tr.comm()
    other = sorted({e.op for e in events if e.op not in P2P_SEND | P2P_RECV})
    if other:
        return f"ring attention passes K/V with isend/irecv (or send/recv) only; it called {', '.join(other)}"
    sends = [e for e in events if e.op in P2P_SEND]
    recvs = [e for e in events if e.op in P2P_RECV]
    if {e.peer for e in sends} - {nxt} or {e.peer for e in recvs} - {prv}:
        return (f"ring attention talks to its ring neighbours only: send to rank {nxt}, receive from rank {prv}; "
                f"it sent to {sorted({e.peer for e in sends})} and received from {sorted({e.peer for e in recvs})}")
    want = (t - 1) * block_bytes
    sent, got = sum(e.nbytes for e in sends), sum(e.nbytes for e in recvs)
    if sent != want or got != want or len(sends) not in (t - 1, 2 * (t - 1)):
        return (f"forward sent {len(sends)} messages of {sent} B in all and received {got} B; expected the K/V block "
                f"({block_bytes} B) passed on P−1 = {t - 1} times (k and v together or in two messages)")
    return None


def _raises(fn, args, what) -> list:
    """The call must raise ValueError before any communication."""
    try:
        with trace() as tr:
            fn(*args)
    except ValueError:
        return [None if not tr.comm() else f"raised ValueError only after communicating ({show(traffic(tr))}): "
                f"raise it before any message when {what} (the other ranks would wait for you)"]
    return [f"returned although {what}; the lab asks for a ValueError"]


def unchanged(inputs, before) -> str | None:
    """The caller's tensors must come back as they went in (no in-place edit of an input)."""
    for name, x, was in zip(("the 1st", "the 2nd", "the 3rd", "the 4th"), inputs, before):
        if not torch.equal(x.detach().cpu(), was):
            return (f"{name} input was modified in place: a graded function must leave the caller's tensors "
                    "unchanged (work on a copy, or use out-of-place operations)")
    return None


def _snapshot(inputs):
    return [x.detach().cpu().clone() for x in inputs]


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
def case_all_to_all(fn, case, r, t, group):
    sd, gd, dtype = case["scatter"], case["gather"], case["dtype"]
    shape = list(case["local"])
    shape[gd] *= t
    full = randn(shape, 1, dtype)
    if case.get("raises"):
        return _raises(fn, (on_rank(part(full, gd, r, t)), sd, gd, group), f"dim {sd} of size {shape[sd]} does "
                       f"not split into {t} equal chunks")
    up = randn(shape, 2, dtype)
    x = on_rank(part(full, gd, r, t)).requires_grad_()
    given = x * 1
    before = _snapshot([given])
    with trace() as tf:
        out = fn(given, sd, gd, group)
    changed = unchanged([given], before)
    with trace() as tb:
        (out * on_rank(part(up, sd, r, t))).sum().backward()
    errs = [err("the output", out, part(full, sd, r, t)), err("x.grad", x.grad, part(up, gd, r, t)), changed]
    if t > 1 and not any(errs):
        one = Counter({("all-to-all", x.numel() * x.element_size()): 1})
        errs += [compare_all_to_alls(traffic(tf), one, "forward"), compare_all_to_alls(traffic(tb), one, "backward")]
    return errs


def _qkv(case, t):
    h, h_kv, dtype = case.get("h", H), case.get("h_kv", case.get("h", H)), case["dtype"]
    q = randn((B, S, h, D), 10) * case.get("q_scale", 1.0)
    k, v, w = randn((B, S, h_kv, D), 11), randn((B, S, h_kv, D), 12), randn((B, S, h, D), 13)
    return [x.to(dtype).to(F64) for x in (q, k, v, w)], h, h_kv, dtype


def case_ulysses(fn, case, r, t, group):
    (q, k, v, w), h, h_kv, dtype = _qkv(case, t)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    if case.get("raises") and not (h % t or h_kv % t):
        return [None]                           # the rank left alone by t = 3: its group of one splits anything
    if case.get("raises"):
        bad = " and ".join(f"the {c} {n} heads" for n, c in (("query", h), ("kv", h_kv)) if c % t)
        return _raises(fn, tuple(on_rank(cut(x)) for x in (q, k, v)) + (case["causal"], group),
                       f"{bad} do not split over P = {t} ranks")
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*full, case["causal"])
    (ref * w).sum().backward()
    mine = [on_rank(cut(x)).requires_grad_() for x in (q, k, v)]
    before = _snapshot(mine)
    with trace() as tf:
        out = fn(*mine, case["causal"], group)
    changed = unchanged(mine, before)
    with trace() as tb:
        (out * on_rank(cut(w))).sum().backward()
    errs = [err("the output", out, cut(ref.detach()))]
    errs += [err(f"{n}.grad", x.grad, cut(f.grad)) for n, x, f in zip("qkv", mine, full)] + [changed]
    if t > 1 and not any(errs):
        want = cost.ulysses_collectives(B, S, h, D, t, h_kv, elem_bytes=mine[0].element_size())
        for phase, tr in (("forward", tf), ("backward", tb)):
            errs.append(compare_all_to_alls(traffic(tr), Counter(("all-to-all", c.nbytes) for c in want
                                                                 if c.phase == phase), phase))
    return errs


def _overlap(r, group, start, first) -> str | None:
    """The overlap case: group rank 0 started ``LATE_S`` late; rank 1, which receives its next K/V
    block from rank 0, must have begun its own block's compute before rank 0 even started (so
    before the late message can land)."""
    times = torch.tensor([start if r == 0 else 0.0, (first or 0.0) if r == 1 else 0.0], dtype=F64,
                         device=rank_device())
    dist.all_reduce(times, group=group)         # rank 0's start and rank 1's first compute, outside the trace
    late_start, first = times.tolist()
    if r != 1:
        return None
    if first == 0.0:
        return "no block was computed (no matrix product seen): attend your queries to your own K/V block"
    if first > late_start:
        return (f"with rank 0 (which sends you the next K/V block) starting {LATE_S} s late, your own block's "
                f"compute began only {first - late_start:.2f} s after rank 0 started: the pass must travel while "
                "you compute. Post isend/irecv, compute the block you hold, then wait")
    return None


def case_ring(fn, case, r, t, group):
    (q, k, v, _), h, h_kv, dtype = _qkv(case, t)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    ref, lse = reference_attention(q, k, v, case["causal"])
    mine = [on_rank(cut(x)) for x in (q, k, v)]
    before = _snapshot(mine)
    blocking = blocking_p2p() if case.get("blocking") else contextlib.nullcontext()
    seen = FirstCompute() if case.get("late") else contextlib.nullcontext()
    if case.get("late"):
        dist.barrier(group=group)               # a common start (outside the trace), then rank 0 is late
        if r == 0:
            time.sleep(LATE_S)
    start = time.time()
    with blocking, trace() as tf, seen:
        result = fn(*mine, case["causal"], group)
    late = _overlap(r, group, start, seen.first) if case.get("late") else None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return ["ring_attention_forward must return (out, lse)"]
    out, my_lse = result
    lse_dtype = F64 if dtype == F64 else F32                    # the helper's: float32 at least
    errs = [err("the output", out, cut(ref), dtype=dtype),
            err("the lse", my_lse, part(lse, 2, r, t), dtype=lse_dtype), unchanged(mine, before), late]
    if t > 1 and not any(errs):
        block = cost.ring_attention_messages(B, S, h_kv, D, t, elem_bytes=mine[0].element_size())[0].nbytes
        errs.append(ring_traffic(tf, r, t, group, block))
    return errs


def case_zigzag(fn, case, r, t, group):
    shape, dtype = case["shape"], case["dtype"]
    x = torch.arange(math.prod(shape), device="cpu").view(shape).to(dtype)
    if shape[SEQ] % (2 * t):
        return _raises(fn, (on_rank(x), group), f"a sequence of {shape[SEQ]} does not cut into 2P = {2 * t} chunks")
    given = on_rank(x)
    with trace() as tr:
        out = fn(given, group)
    errs = [err("the shard", out, zigzag_part(x, r, t)), unchanged([given], [x])]
    if tr.comm():
        errs.append(f"zigzag_shard communicated ({show(traffic(tr))}): every rank holds the full tensor already")
    return errs


CASE_RUNNERS = {"all_to_all": case_all_to_all, "ulysses_attention": case_ulysses,
                "ring_attention_forward": case_ring, "zigzag_shard": case_zigzag}


# ----------------------------------------------------------------------------- the merge, in this process
def merge_cases(hidden: bool) -> list[dict]:
    cases = [dict(shape=(2, 3, 5, 4), dtype=F32, spread=3.0, offset=0.0)]
    if hidden:          # far-apart lse's (one side negligible), and lse's where exp overflows without the max
        cases += [dict(shape=(2, 3, 5, 4), dtype=F64, spread=3.0, offset=0.0),
                  dict(shape=(4, 7, 8), dtype=F32, spread=60.0, offset=0.0),
                  dict(shape=(2, 3, 5, 4), dtype=F32, spread=5.0, offset=400.0),
                  dict(shape=(2, 3, 5, 4), dtype=F64, spread=5.0, offset=1000.0),
                  dict(shape=(2, 3, 5, 4), dtype=BF16, spread=3.0, offset=0.0)]
    return cases


def merge_inputs(case: dict):
    shape, dtype = case["shape"], case["dtype"]
    out_a, out_b = randn(shape, 40, dtype), randn(shape, 41, dtype)
    lse_a = (case["offset"] + case["spread"] * randn(shape[:-1], 42)).to(dtype)
    lse_b = (case["offset"] + case["spread"] * randn(shape[:-1], 43)).to(dtype)
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    out = ((lse_a.double() - lse).exp()[..., None] * out_a.double()
           + (lse_b.double() - lse).exp()[..., None] * out_b.double())
    return (out_a, lse_a, out_b, lse_b), (out, lse)
