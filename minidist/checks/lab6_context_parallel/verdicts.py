"""Lab 6's verdicts: one rank's result against full attention of the whole sequence in float64 on
the CPU (SDPA and ``torch.logsumexp``), the merge against a float64 ``logaddexp`` merge, and the
traced communication against :mod:`minidist.cost.context_parallel`.

Jacobs et al. 2023 (DeepSpeed-Ulysses, Sec. 3: the all-to-alls and their bytes); Liu et al. 2023
(Ring Attention, Sec. 3: K/V blocks to the next rank only, P−1 passes); Brandon et al. 2023 and
Zhu's ring-flash-attention (zigzag: chunks r and 2P−1−r of 2P); Milakov & Gimelshein 2018 and Dao
et al. 2022 (the log-sum-exp merge). Every value goes through the kit's one comparison at the
kit's tolerance by dtype (fp64 held to 1e-9: a merge or ring that rounds fp64 through fp32 is off
by ~1e-7); references are rebuilt from the case's seeds (:mod:`.cases`).
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F

from minidist import cost
from minidist.checks.kit.compare import first, tensor_error, traffic_problem, untouched
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.raises import raise_verdict
from minidist.checks.lab6_context_parallel.cases import (B, D, F32, F64, LATE_S, MERGE, S, SEQ, a2a_inputs,
                                                         merge_inputs, part, qkv, zigzag_input)

PHASES = ("forward", "backward")


# ----------------------------------------------------------------------------- references
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


def zigzag_part(x, r, t, dim=SEQ):
    """Chunks r and 2t−1−r of 2t along ``dim``."""
    chunks = x.tensor_split(2 * t, dim=dim)
    return torch.cat([chunks[r], chunks[2 * t - 1 - r]], dim=dim)


def attention_slip(got, q, k, v, causal, cut, dtype=None) -> str:
    """"; likely cause: ..." when ``got`` equals full attention with one classic slip (the 1/√d
    scale left out, the causal mask ignored or added), cut to the rank's part by ``cut``; else ""."""
    if not isinstance(got, torch.Tensor):
        return ""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    slips = [("attention without the 1/√d scale: softmax(q·kᵀ) instead of softmax(q·kᵀ/√d)", causal, 1.0),
             ("attention without the causal mask" if causal else "causal attention, where no mask was asked",
              not causal, None)]
    for words, masked, scale in slips:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=masked, scale=scale, enable_gqa=True)
        if tensor_error("", got, cut(out.transpose(1, 2)), dtype=dtype) is None:
            return f"; likely cause: it equals {words}"
    return ""


def zigzag_held(got, x, r, t) -> str:
    """"; likely cause: your shard holds chunks i and j ..." when ``got`` is two of the 2t chunks of ``x``
    along the sequence, but not chunks r and 2t−1−r; else ""."""
    chunks = x.tensor_split(2 * t, dim=SEQ)
    if not isinstance(got, torch.Tensor) or got.dim() != x.dim():
        return ""
    held = [next((i for i, c in enumerate(chunks) if c.shape == p.shape and torch.equal(c, p)), None)
            for p in got.tensor_split(2, dim=SEQ)]
    if None in held or held == [r, 2 * t - 1 - r]:
        return ""
    return (f"; likely cause: your shard holds chunks {held[0]} and {held[1]} of the 2P = {2 * t} along the sequence; "
            f"rank r holds chunks r and 2P−1−r (here {r} and {2 * t - 1 - r}), so that every rank gets an equal "
            f"share of the causal triangle")


def merged(out_a, lse_a, out_b, lse_b):
    """The merge in float64: lse = logaddexp(lse_a, lse_b), out = Σ exp(lse_x − lse)·out_x."""
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    out = ((lse_a.double() - lse).exp()[..., None] * out_a.double()
           + (lse_b.double() - lse).exp()[..., None] * out_b.double())
    return out, lse


def given_unchanged(digests: list, names: str | tuple, inputs: list) -> str | None:
    """The caller's tensors ``names`` came back as they went in (``digests`` of them after the call)."""
    return untouched(dict(zip(names, digests)), dict(zip(names, inputs)))


# ----------------------------------------------------------------------------- traffic
def compare_all_to_alls(got: list, want: Counter, phase: str) -> str | None:
    """Equal multisets, or (qkv packed into fewer calls) only all-to-alls with the same total bytes."""
    total = lambda c: sum(b * n for (_, b), n in c.items())        # noqa: E731
    return traffic_problem(phase, got, want, lambda g, w: {k for k, _ in g} == {"all-to-all"} and total(g) == total(w))


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


def overlap(r, times) -> str | None:
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


# ----------------------------------------------------------------------------- one verdict per function
def exchange(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    sd, gd = case["scatter"], case["gather"]
    shape, full, up = a2a_inputs(case, t)
    if case.get("raises"):
        return raise_verdict(answer, f"dim {sd} of size {shape[sd]} does not split into {t} equal chunks")
    x = part(full, gd, r, t)
    errs = [tensor_error("the output", answer["out"], part(full, sd, r, t)),
            tensor_error("x.grad", answer["grad"], part(up, gd, r, t)), given_unchanged([answer["given"]], "x", [x])]
    if t > 1 and not any(errs):
        one = Counter({("all-to-all", x.numel() * x.element_size()): 1})
        errs += [compare_all_to_alls(answer[phase], one, phase) for phase in PHASES]
    return first(errs)


def ulysses(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    (q, k, v, w), h, h_kv, dtype = qkv(case)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    if case.get("raises") and not (h % t or h_kv % t):
        return None
    if case.get("raises"):
        bad = " and ".join(f"the {c} {n} heads" for n, c in (("query", h), ("kv", h_kv)) if c % t)
        return raise_verdict(answer, f"{bad} do not split over P = {t} ranks")
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*full, case["causal"])
    (ref * w).sum().backward()
    errs = [tensor_error("the output", answer["out"], cut(ref.detach()))]
    if errs[0]:
        errs[0] += attention_slip(answer["out"], q, k, v, case["causal"], cut)
    errs += [tensor_error(f"{n}.grad", g, cut(f.grad)) for n, g, f in zip("qkv", answer["grads"], full)]
    errs.append(given_unchanged(answer["given"], "qkv", [cut(x) for x in (q, k, v)]))
    if t > 1 and not any(errs):
        want = cost.ulysses_collectives(B, S, h, D, t, h_kv, elem_bytes=torch.empty(0, dtype=dtype).element_size())
        errs += [compare_all_to_alls(answer[phase], Counter(("all-to-all", c.nbytes) for c in want if c.phase == phase),
                                     phase) for phase in PHASES]
    return first(errs)


def ring(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    (q, k, v, _), _, h_kv, dtype = qkv(case)
    cut = lambda x: part(x, SEQ, r, t).to(dtype)                 # noqa: E731
    if not answer["shape"]:
        return "ring_attention_forward must return (out, lse)"
    ref, lse = reference_attention(q, k, v, case["causal"])
    lse_dtype = F64 if dtype == F64 else F32                    # the helper's: float32 at least
    errs = [tensor_error("the output", answer["out"], cut(ref), dtype=dtype),
            tensor_error("the lse", answer["lse"], part(lse, 2, r, t), dtype=lse_dtype),
            given_unchanged(answer["given"], "qkv", [cut(x) for x in (q, k, v)]),
            overlap(r, answer["late"]) if case.get("late") else None]
    if errs[0]:
        errs[0] += attention_slip(answer["out"], q, k, v, case["causal"], cut, dtype)
    if t > 1 and not any(errs):
        elem = torch.empty(0, dtype=dtype).element_size()
        block = cost.ring_attention_messages(B, S, h_kv, D, t, elem_bytes=elem)[0].nbytes
        errs.append(ring_traffic(answer["events"], r, t, block))
    return first(errs)


def zigzag(item, answer) -> str | None:
    case, r, t = item.case, item.r, item.t
    x, seq = zigzag_input(case), case["shape"][SEQ]
    if seq % (2 * t):
        return raise_verdict(answer, f"a sequence of {seq} does not cut into 2P = {2 * t} chunks")
    errs = [tensor_error("the shard", answer["out"], zigzag_part(x, r, t)), given_unchanged([answer["given"]], "x", [x])]
    if errs[0]:
        errs[0] += zigzag_held(answer["out"], x, r, t)
    if answer["traffic"]:
        ops = ", ".join(f"{k} of {b} B" for k, b in answer["traffic"])
        errs.append(f"zigzag_shard communicated ({ops}): every rank holds the full tensor already")
    return first(errs)


def merge(case, answer) -> str | None:
    """The merge (in the calling process) against the float64 merge of the same inputs."""
    label, result = f"{MERGE} ({describe_case(case)})", answer["result"]
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"{label}: must return (out, lse), got {type(result).__name__}"
    args = merge_inputs(case)
    want_out, want_lse = merged(*args)
    # out = w_a·out_a + w_b·out_b with w = exp(lse_x - lse): a correct merge that rounds lse
    # (e.g. through logaddexp) first moves each weight by up to ulp(lse), relative
    top = max(a.abs().max().item() for a in (args[1], args[3]))
    rounding = 2 * torch.finfo(case["dtype"]).eps * top * max(a.abs().max().item() for a in (args[0], args[2]))
    problem = (tensor_error("out", result[0], want_out, slack=rounding, dtype=case["dtype"])
               or tensor_error("lse", result[1], want_lse, dtype=case["dtype"])
               or given_unchanged(answer["given"], ("out_a", "lse_a", "out_b", "lse_b"), args))
    if problem:
        finite = all(torch.isfinite(r).all() for r in result if isinstance(r, torch.Tensor))
        big = f" (lse's reach {top:.0f} here: does an exp overflow?)" if top > 80 and not finite else ""
        return f"{label}: {problem}{big}"
    return None


#: per distributed graded function: verdict(RankCase, answer)
VERDICT = {"all_to_all": exchange, "ulysses_attention": ulysses, "ring_attention_forward": ring,
           "zigzag_shard": zigzag}
