"""Lab 6's cases (context parallelism): the graded functions, their visible cases (the hidden ones
are the grader's, in ``hidden.py``), the checks' sizes, the inputs every rank and the verdict draw
from seeds (on the CPU, in float64 then cast), and the ✓ text.

A distributed case is a dict with ``t``, the size of the context-parallel group it runs on (4 ranks
cut into blocks of t consecutive ranks: t = 3 leaves rank 3 in a group of one, t = 4 is
``group=None``); the merge's cases run in the calling process. The hidden cases of a launch are
ordered cheap-to-reach first: a launch stops at its first failing case.
"""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import seeded
from minidist.checks.kit.withheld import hidden_cases

WORLD, B, S, H, D = 4, 2, 24, 12, 4     # S divisible by 2P for P = 1..4; H by 1..4
SEQ, HEADS = 1, 2                       # (batch, seq, heads, head_dim)
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
LATE_S = 0.6                            # the late peer of the overlap case starts this much after the others

MERGE = "merge_partial_attention"       # no communication: checked in the calling process
GRADED = ("all_to_all", "ulysses_attention", MERGE, "ring_attention_forward", "zigzag_shard")


#: the visible cases of the rules the text stresses, after the others: each function's ValueError (a
#: dim, query heads, a sequence that does not split), and the ring's overlap with a late peer
VISIBLE_RULES = {"all_to_all": [dict(t=4, local=(B, 3, 2, D), scatter=2, gather=1, dtype=F32, raises=True)],
                 "ulysses_attention": [dict(t=4, causal=False, dtype=F32, h=6, raises=True)],
                 "ring_attention_forward": [dict(t=2, causal=True, dtype=F32, late=True)]}
ZIGZAG_VISIBLE = [((B, S, H, D), F32), ((2, 20), F32)]      # s = 20 cuts into 2P chunks at t = 2, not at t = 4


def function_cases(name: str, hidden: bool) -> list[dict]:
    """The cases of a distributed graded function ``name``. Visible: t = 2 and 4 (the ring's also one
    run with every isend/irecv blocking), a ValueError each (``VISIBLE_RULES``, zigzag's s = 20 at
    t = 4) and the ring's late peer; hidden: t = 1..4 and other dims, fp64 and bf16, GQA and MQA,
    scores far past exp's range, more heads that do not split, another late peer, more sequences
    that do not cut into 2P chunks."""
    h = hidden_cases(__package__, name) if hidden else None
    ts = h.TS if hidden else (2, 4)
    if name == "all_to_all":
        variants = [dict(local=(B, 3, H, D), scatter=2, gather=1, dtype=F32),      # (b, s/P, h, d) → (b, s, h/P, d)
                    dict(local=(B, H, 3, D), scatter=1, gather=2, dtype=F32)]      # and back
        variants += h.ALL_TO_ALL if hidden else []
        cases = [dict(t=t, **v) for t in ts for v in variants if v["local"][v["scatter"]] % t == 0]
        return cases + (h.ALL_TO_ALL_RAISES if hidden else VISIBLE_RULES[name])
    if name in ("ulysses_attention", "ring_attention_forward"):
        cases = [dict(t=t, causal=c, dtype=F32) for t in ts for c in (False, True)]
        if name == "ring_attention_forward":    # visible too: every isend/irecv blocks until matched (NCCL's worst)
            cases += [dict(t=4, causal=True, dtype=F32, blocking=True)]
        return cases + (h.ATTENTION[name] if hidden else VISIBLE_RULES[name])
    if name == "zigzag_shard":
        shapes = [((B, S, H, D), F32)] + h.ZIGZAG_SHAPES if hidden else ZIGZAG_VISIBLE
        return [dict(t=t, shape=s, dtype=d) for t in ts for s, d in shapes]
    raise ValueError(f"lab 6 has no graded function {name!r}; graded: {', '.join(GRADED)}")


def merge_cases(hidden: bool) -> list[dict]:
    """The merge's cases: far-apart lse's (one side negligible), and lse's where exp overflows without the max."""
    return [dict(shape=(2, 3, 5, 4), dtype=F32, spread=3.0, offset=0.0)] + (
        hidden_cases(__package__, MERGE).MERGE if hidden else [])


#: what a passing test compared, in a few words (the ✓ line)
COMPARED = {
    "all_to_all": "output, x.grad and one all-to-all each way",
    "ulysses_attention": "output, q/k/v grads and the all-to-alls vs the cost model",
    MERGE: "out and lse vs a float64 logaddexp merge",
    "ring_attention_forward": "out and lse, K/V passes to the next rank only, a blocking order",
    "zigzag_shard": "chunks r and 2P-1-r, no communication",
}


def covered(name: str, hidden: bool) -> str:
    """The ✓ line's text, from the cases that ran."""
    cases = merge_cases(hidden) if name == MERGE else function_cases(name, hidden)
    ts = sorted({c["t"] for c in cases if "t" in c})
    dtypes = sorted({str(c["dtype"]).replace("torch.", "") for c in cases})
    extra = []
    if any(c.get("raises") or c.get("shape", (0, 0))[SEQ] % (2 * c.get("t", 1)) for c in cases):
        extra.append("ValueError before any message")
    if any(c.get("late") for c in cases):
        extra.append("overlap with a late peer")
    where = f"t={', '.join(map(str, ts))}; " if ts else ""
    return f"{where}{'/'.join(dtypes)}; {COMPARED[name]}" + "".join(f"; {e}" for e in extra) + "; inputs unchanged"


# ----------------------------------------------------------------------------- inputs (CPU, from seeds)
def part(x, dim, r, t):
    """Rank r's chunk of t along ``dim`` (``tensor_split`` order)."""
    return x.tensor_split(t, dim=dim)[r]


def a2a_inputs(case: dict, t: int):
    """(the full shape, the full input, the upstream gradient): rank r holds chunk r along the gather dim."""
    shape = list(case["local"])
    shape[case["gather"]] *= t
    return shape, seeded(shape, 1, case["dtype"]), seeded(shape, 2, case["dtype"])


def qkv(case: dict):
    """([q, k, v, upstream gradient] of the whole sequence, rounded to the case's dtype and held in
    float64, the references' precision), query heads, kv heads, the case's dtype."""
    h, h_kv, dtype = case.get("h", H), case.get("h_kv", case.get("h", H)), case["dtype"]
    q = seeded((B, S, h, D), 10, F64) * case.get("q_scale", 1.0)
    k, v, w = seeded((B, S, h_kv, D), 11, F64), seeded((B, S, h_kv, D), 12, F64), seeded((B, S, h, D), 13, F64)
    return [x.to(dtype).to(F64) for x in (q, k, v, w)], h, h_kv, dtype


def zigzag_input(case: dict) -> torch.Tensor:
    """0, 1, 2, ... in the case's shape and dtype: every element says where it came from."""
    shape = case["shape"]
    return torch.arange(torch.Size(shape).numel(), device="cpu").view(shape).to(case["dtype"])


def merge_inputs(case: dict) -> tuple:
    """(out_a, lse_a, out_b, lse_b) in the case's dtype; the lse's ``offset`` ± ``spread``."""
    shape, dtype = case["shape"], case["dtype"]
    out_a, out_b = seeded(shape, 40, dtype), seeded(shape, 41, dtype)
    lse_a = (case["offset"] + case["spread"] * seeded(shape[:-1], 42, F64)).to(dtype)
    lse_b = (case["offset"] + case["spread"] * seeded(shape[:-1], 43, F64)).to(dtype)
    return out_a, lse_a, out_b, lse_b
