"""Lab 6's case data and comparisons: inputs every rank draws from seeds (so one process rebuilds
any rank's case), full attention in fp64 on the CPU (the reference), how a result is compared
with it (its dtype exactly, within ``tol(dtype)`` of its scale), and the traffic the cost model
expects (:mod:`minidist.cost.context_parallel`). Used by the runners in
:mod:`minidist.checks.lab6_cases` and the merge's check in :mod:`minidist.checks.lab6_context_parallel`.
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F

from minidist.checks.kit.launch import TOL
from minidist.checks.kit.docket import digest
from minidist.checks.kit.returned import tensor_problem
from minidist.runtime.device import device as rank_device

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
    if problem := tensor_problem(what, got, want):
        return problem
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


def traffic(tr) -> list:
    """[kind, bytes] of every operation a trace holds, sorted (an answer's record of its traffic)."""
    return sorted([FAMILY.get(e.op, e.op), e.nbytes] for e in tr.comm())


def show(c: Counter) -> str:
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def compare_all_to_alls(got: list, want: Counter, phase: str) -> str | None:
    """Equal multisets, or (qkv packed into fewer calls) only all-to-alls with the same total bytes."""
    got = Counter(tuple(x) for x in got)
    total = lambda c: sum(b * n for (_, b), n in c.items())        # noqa: E731
    if got == want or ({k for k, _ in got} == {"all-to-all"} and total(got) == total(want)):
        return None
    return f"{phase} communicated {show(got)}; expected {show(want)}"


def ring_traffic(events: list, r: int, t: int, block_bytes: int) -> str | None:
    """K/V go to the next rank only, come from the previous only: P−1 blocks (k and v together or
    apart). ``events``: [kind, bytes, peer's rank in the group (None outside it)] of each operation."""
    nxt, prv = (r + 1) % t, (r - 1) % t
    other = sorted({op for op, _, _ in events if op not in ("send", "recv")})
    if other:
        return f"ring attention passes K/V with isend/irecv (or send/recv) only; it called {', '.join(other)}"
    sends = [(b, peer) for op, b, peer in events if op == "send"]
    recvs = [(b, peer) for op, b, peer in events if op == "recv"]
    to, got_from = {p for _, p in sends}, {p for _, p in recvs}
    if to - {nxt} or got_from - {prv}:
        name = lambda ps: sorted(("outside the group" if p is None else p) for p in ps)     # noqa: E731
        return (f"ring attention talks to its ring neighbours only: send to group rank {nxt}, receive from group "
                f"rank {prv}; it sent to {name(to)} and received from {name(got_from)}")
    want = (t - 1) * block_bytes
    sent, got = sum(b for b, _ in sends), sum(b for b, _ in recvs)
    if sent != want or got != want or len(sends) not in (t - 1, 2 * (t - 1)):
        return (f"forward sent {len(sends)} messages of {sent} B in all and received {got} B; expected the K/V block "
                f"({block_bytes} B) passed on P−1 = {t - 1} times (k and v together or in two messages)")
    return None


def unchanged(digests: list, inputs: list) -> str | None:
    """The caller's tensors must come back as they went in (no in-place edit of an input): ``digests``
    (:func:`minidist.checks.kit.docket.digest`) of them after the call, ``inputs`` as they went in."""
    for name, got, was in zip(("the 1st", "the 2nd", "the 3rd", "the 4th"), digests, inputs):
        if got != digest(was):
            return (f"{name} input was modified in place: a graded function must leave the caller's tensors "
                    "unchanged (work on a copy, or use out-of-place operations)")
    return None


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
