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
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import cost
from minidist.checks.common import TOL
from minidist.runtime.strict_async import blocking_p2p
from minidist.trace import P2P_RECV, P2P_SEND, trace

WORLD, B, S, H, D = 4, 2, 24, 12, 4     # S divisible by 2P for P = 1..4; H by 1..4
SEQ, HEADS = 1, 2                       # (batch, seq, heads, head_dim)
F32, F64 = torch.float32, torch.float64


# ----------------------------------------------------------------------------- data, references
def randn(shape, seed, dtype=F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


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
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
    return out, lse


def err(what, got, want, slack: float = 0.0) -> str | None:
    """Why ``got`` is not ``want`` (None if it is, within TOL relative to its scale, + ``slack``)."""
    if got is None:
        return f"{what} is None: no gradient reached it (was it detached, or built outside autograd?)"
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype.is_floating_point != want.dtype.is_floating_point:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    got = got.detach().to(want.dtype)
    if not want.dtype.is_floating_point:
        return None if torch.equal(got, want) else f"{what} holds other elements than expected"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= TOL * scale + slack:           # NaN fails too
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
        return [None if not tr.comm() else f"raised ValueError only after communicating: check {what} first, "
                "before any message (the other ranks would wait for you)"]
    return [f"returned although {what}; the lab asks for a ValueError"]


# ----------------------------------------------------------------------------- one runner per function
def case_all_to_all(fn, case, r, t, group):
    sd, gd, dtype = case["scatter"], case["gather"], case["dtype"]
    shape = list(case["local"])
    shape[gd] *= t
    full = randn(shape, 1, dtype)
    if case.get("raises"):
        return _raises(fn, (part(full, gd, r, t), sd, gd, group), f"dim {sd} of size {shape[sd]} does not split "
                       f"into {t} equal chunks")
    up = randn(shape, 2, dtype)
    x = part(full, gd, r, t).clone().requires_grad_()
    with trace() as tf:
        out = fn(x * 1, sd, gd, group)
    with trace() as tb:
        (out * part(up, sd, r, t)).sum().backward()
    errs = [err("the output", out, part(full, sd, r, t)), err("x.grad", x.grad, part(up, gd, r, t))]
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
    if case.get("raises"):
        return _raises(fn, (cut(q), cut(k), cut(v), case["causal"], group), f"{h} heads do not split over {t} ranks")
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*full, case["causal"])
    (ref * w).sum().backward()
    mine = [cut(x).requires_grad_() for x in (q, k, v)]
    with trace() as tf:
        out = fn(*mine, case["causal"], group)
    with trace() as tb:
        (out * cut(w)).sum().backward()
    errs = [err("the output", out, cut(ref.detach()))]
    errs += [err(f"{n}.grad", x.grad, cut(f.grad)) for n, x, f in zip("qkv", mine, full)]
    if t > 1 and not any(errs):
        want = cost.ulysses_collectives(B, S, h, D, t, h_kv, elem_bytes=mine[0].element_size())
        for phase, tr in (("forward", tf), ("backward", tb)):
            errs.append(compare_all_to_alls(traffic(tr), Counter(("all-to-all", c.nbytes) for c in want
                                                                 if c.phase == phase), phase))
    return errs


def case_ring(fn, case, r, t, group):
    (q, k, v, _), h, h_kv, dtype = _qkv(case, t)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    ref, lse = reference_attention(q, k, v, case["causal"])
    mine = [cut(x) for x in (q, k, v)]
    ctx = blocking_p2p() if case.get("blocking") else contextlib.nullcontext()
    with ctx, trace() as tf:
        result = fn(*mine, case["causal"], group)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return ["ring_attention_forward must return (out, lse)"]
    out, my_lse = result
    errs = [err("the output", out, cut(ref)), err("the lse", my_lse, part(lse, 2, r, t))]
    if t > 1 and not any(errs):
        block = cost.ring_attention_messages(B, S, h_kv, D, t, elem_bytes=mine[0].element_size())[0].nbytes
        errs.append(ring_traffic(tf, r, t, group, block))
    return errs


def case_zigzag(fn, case, r, t, group):
    shape, dtype = case["shape"], case["dtype"]
    x = torch.arange(math.prod(shape)).view(shape).to(dtype)
    if shape[SEQ] % (2 * t):
        return _raises(fn, (x, group), f"a sequence of {shape[SEQ]} does not cut into 2P = {2 * t} chunks")
    with trace() as tr:
        out = fn(x, group)
    errs = [err("the shard", out, zigzag_part(x, r, t))]
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
                  dict(shape=(2, 3, 5, 4), dtype=F64, spread=5.0, offset=1000.0)]
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
