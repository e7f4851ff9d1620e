"""Lab 6's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`: t = 1..4 and other
dims, fp64 and bf16, GQA and MQA, scores far past exp's range, heads that do not split, a late peer,
sequences that do not cut into 2P chunks. Within a launch they come cheap-to-reach first: a launch
stops at its first failing case."""
import torch

from minidist.checks.lab6_context_parallel.cases import B, D, H, S

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

#: the group sizes every distributed function runs on
TS = (1, 2, 3, 4)

#: all_to_all: variants after the visible ones (run for each t that divides the scattered dim), then
#: a case that must raise
ALL_TO_ALL = [dict(local=(H, 5, 2), scatter=0, gather=-1, dtype=F64),
              dict(local=(2, 3, 5), scatter=-1, gather=1, dtype=F32),
              dict(local=(B, 2, H, D), scatter=2, gather=1, dtype=BF16)]
ALL_TO_ALL_RAISES = [dict(t=4, local=(B, 3, 6, D), scatter=2, gather=1, dtype=F32, raises=True)]


def _attention(name: str) -> list[dict]:
    """The attention functions' cases after the visible ones."""
    if name == "ulysses_attention":     # only the kv heads not divisible by P (the query heads: visible)
        cases = [dict(t=4, causal=False, dtype=F32, h=8, h_kv=2, raises=True),
                 dict(t=3, causal=True, dtype=F32, h_kv=4, raises=True)]
    else:
        cases = [dict(t=t, causal=True, dtype=BF16) for t in (2, 4)]              # out in q's dtype
        cases += [dict(t=4, causal=True, dtype=F32, late=True)]     # a late peer: compute overlaps the pass
    kv = {1: 4, 2: 4, 3: 6, 4: 4} if name == "ulysses_attention" else {1: 1, 2: 4, 3: 3, 4: 1}
    cases += [dict(t=t, causal=True, dtype=F32, h_kv=kv[t]) for t in TS]            # GQA / MQA
    cases += [dict(t=t, causal=c, dtype=F64) for t in (3, 4) for c in (False, True)]
    cases += [dict(t=t, causal=True, dtype=F32, q_scale=100.0) for t in (2, 4)]     # scores in the thousands
    if name == "ring_attention_forward":    # every isend/irecv blocking: deadlock-free on its own
        cases += [dict(t=t, causal=True, dtype=F32, blocking=True) for t in (2, 3)]
    return cases


ATTENTION = {name: _attention(name) for name in ("ulysses_attention", "ring_attention_forward")}

#: zigzag_shard: (shape, dtype) after the visible one
ZIGZAG_SHAPES = [((1, S), torch.int64), ((3, 12, 2), F64), ((2, 20), F32), ((2, S, 3), BF16)]

#: merge_partial_attention: far-apart lse's (one side negligible), lse's where exp overflows without the max
MERGE = [dict(shape=(2, 3, 5, 4), dtype=F64, spread=3.0, offset=0.0),
         dict(shape=(4, 7, 8), dtype=F32, spread=60.0, offset=0.0),
         dict(shape=(2, 3, 5, 4), dtype=F32, spread=5.0, offset=400.0),
         dict(shape=(2, 3, 5, 4), dtype=F64, spread=5.0, offset=1000.0),
         dict(shape=(2, 3, 5, 4), dtype=BF16, spread=3.0, offset=0.0)]
