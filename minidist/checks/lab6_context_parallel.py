"""Lab 6's checks (context parallelism: DeepSpeed-Ulysses and ring attention): each graded
function against full attention in one process, and its traced communication against the cost model.

Jacobs et al. 2023 (DeepSpeed-Ulysses); Liu et al. 2023 (Ring Attention); Milakov & Gimelshein
2018 and Dao et al. 2022 (the log-sum-exp merge); Brandon et al. 2023 (load-balanced causal
shards). A lab test cell is a one-liner::

    checks.check_function("ring_attention_forward", ring_attention_forward)
    checks.check_function("ring_attention_forward", ring_attention_forward, hidden=True)

One launch of 4 ranks per call runs every case: the ranks are cut into context-parallel groups
of t consecutive ranks (t = 3 leaves rank 3 alone, a group of one; t = 4 is ``group=None``). A
case builds its inputs on the CPU, hands them to the student's code on ``minidist.device()``, and
compares this rank's output (its dtype exactly; and, where the function is differentiable, its
input gradients) on the CPU with fp64 attention of the whole sequence within ``tol(dtype)``;
the caller's tensors must come back unchanged; for t > 1 the traced
communication with :mod:`minidist.cost.context_parallel`: Ulysses' all-to-alls (kind and bytes;
q, k, v packed into fewer calls accepted), the ring's K/V passes (to the next rank only, from the
previous only, P−1 blocks; any deadlock-free order, checked with every isend/irecv made
blocking; and, with one peer starting late, the first block computed before that peer's
message can land: the pass overlaps the compute). ``merge_partial_attention`` has no communication and is checked in this process, on
inputs whose exp overflows without the max. The lab's other functions are stood in for by
minidist's own inside the ranks (``STAND_INS``); minidist's implementation of the graded one is
refused (:mod:`minidist.checks.kit.launch`). The runners are in :mod:`minidist.checks.lab6_cases`, their
data and comparisons in :mod:`minidist.checks.lab6_data`.
"""
from __future__ import annotations

import torch

from minidist import cost
from minidist.checks.kit.launch import check_timeout, launch_named, mark_case, one_thread, report_passed, stand_in_lab_functions
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, digest, judged
from minidist.checks.kit.returned import require_plain
from minidist.checks.kit.groups import (consecutive_groups, describe_case, judged_on_ranks, raise_first_group_problem,
                                    run_cases_in_groups)
from minidist.checks.lab6_cases import CASE_RUNNERS
from minidist.checks.lab6_data import (B, BF16, D, F32, F64, H, S, WORLD, err, merge_cases, merge_inputs, on_rank,
                                       part, randn, unchanged)
from minidist.checks.kit.quiet import passes_quietly
from minidist.context_parallel.all_to_all import all_to_all
from minidist.context_parallel.merge import merge_partial_attention
from minidist.runtime.strict_async import blocking_p2p  # noqa: F401  (the lab's demo: every isend/irecv blocking)
from minidist.trace import trace

CP_CHECK_TIMEOUT = check_timeout(20.0)
_CP = "minidist.context_parallel."

# The lab's functions that another graded function calls, stood in for by minidist's own in every
# test but their own: (stand-in, minidist names it is). A test allows the other functions' names.
STAND_INS = {
    "all_to_all": (all_to_all, ("all_to_all.all_to_all", "all_to_all.AllToAll")),
    "merge_partial_attention": (merge_partial_attention, ("merge.merge_partial_attention",)),
}
GRADED = ("all_to_all", "ulysses_attention", "merge_partial_attention", "ring_attention_forward", "zigzag_shard")

#: minidist.context_parallel is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("context parallelism", ("minidist.context_parallel",), checks=__name__)


def _refusal(name: str) -> Refusal:
    allow = tuple(_CP + a for other, (_, names) in STAND_INS.items() if other != name for a in names)
    return Refusal(REFUSED.technique, REFUSED.modules, allow, REFUSED.checks)


def _body(progress, fn, name, cases):
    stand_in_lab_functions(fn, {other: ref for other, (ref, _) in STAND_INS.items() if other != name})
    return run_cases_in_groups(progress, CASE_RUNNERS[name], fn, cases, WORLD, stop_at_first_failure=True)


def _cases(name: str, hidden: bool) -> list[dict]:
    ts = (1, 2, 3, 4) if hidden else (2, 4)
    if name == "all_to_all":
        variants = [dict(local=(B, 3, H, D), scatter=2, gather=1, dtype=F32),      # (b, s/P, h, d) → (b, s, h/P, d)
                    dict(local=(B, H, 3, D), scatter=1, gather=2, dtype=F32)]      # and back
        if hidden:
            variants += [dict(local=(H, 5, 2), scatter=0, gather=-1, dtype=F64),
                         dict(local=(2, 3, 5), scatter=-1, gather=1, dtype=F32),
                         dict(local=(B, 2, H, D), scatter=2, gather=1, dtype=BF16)]
        cases = [dict(t=t, **v) for t in ts for v in variants if v["local"][v["scatter"]] % t == 0]
        return cases + ([dict(t=4, local=(B, 3, 6, D), scatter=2, gather=1, dtype=F32, raises=True)] if hidden else [])
    if name in ("ulysses_attention", "ring_attention_forward"):
        cases = [dict(t=t, causal=c, dtype=F32) for t in ts for c in (False, True)]
        if name == "ring_attention_forward":    # visible too: every isend/irecv blocks until matched (NCCL's worst)
            cases += [dict(t=4, causal=True, dtype=F32, blocking=True)]
        if hidden:      # the cheap-to-reach kinds first: a bug stops the launch's cases at its first failure
            if name == "ulysses_attention":     # query heads, then only the kv heads, not divisible by P
                cases += [dict(t=4, causal=False, dtype=F32, h=6, raises=True),
                          dict(t=4, causal=False, dtype=F32, h=8, h_kv=2, raises=True),
                          dict(t=3, causal=True, dtype=F32, h_kv=4, raises=True)]
            else:
                cases += [dict(t=t, causal=True, dtype=BF16) for t in (2, 4)]              # out in q's dtype
                cases += [dict(t=2, causal=True, dtype=F32, late=True)]     # a late peer: compute overlaps the pass
            kv = {1: 4, 2: 4, 3: 6, 4: 4} if name == "ulysses_attention" else {1: 1, 2: 4, 3: 3, 4: 1}
            cases += [dict(t=t, causal=True, dtype=F32, h_kv=kv[t]) for t in ts]            # GQA / MQA
            cases += [dict(t=t, causal=c, dtype=F64) for t in (3, 4) for c in (False, True)]
            cases += [dict(t=t, causal=True, dtype=F32, q_scale=100.0) for t in (2, 4)]     # scores in the thousands
            if name == "ring_attention_forward":    # every isend/irecv blocking: deadlock-free on its own
                cases += [dict(t=t, causal=True, dtype=F32, blocking=True) for t in (2, 3)]
        return cases
    if name == "zigzag_shard":
        shapes = [((B, S, H, D), F32)] + ([((1, S), torch.int64), ((3, 12, 2), F64), ((2, 20), F32),
                                           ((2, S, 3), BF16)] if hidden else [])
        return [dict(t=t, shape=s, dtype=d) for t in ts for s, d in shapes]
    raise ValueError(f"lab 6 has no graded function {name!r}; graded: {', '.join(GRADED)}")


#: what a passing test compared, in a few words (the ✓ line)
COMPARED = {
    "all_to_all": "output, x.grad and one all-to-all each way",
    "ulysses_attention": "output, q/k/v grads and the all-to-alls vs the cost model",
    "merge_partial_attention": "out and lse vs a float64 logaddexp merge",
    "ring_attention_forward": "out and lse, K/V passes to the next rank only, a blocking order",
    "zigzag_shard": "chunks r and 2P-1-r, no communication",
}


def _covered(name: str, cases: list[dict], hidden: bool) -> str:
    ts = sorted({c["t"] for c in cases if "t" in c})
    dtypes = sorted({str(c["dtype"]).replace("torch.", "") for c in cases})
    extra = []
    if any(c.get("raises") for c in cases) or (hidden and name == "zigzag_shard"):
        extra.append("ValueError before any message")
    if any(c.get("late") for c in cases):
        extra.append("overlap with a late peer")
    where = f"t={', '.join(map(str, ts))}; " if ts else ""
    return f"{where}{'/'.join(dtypes)}; {COMPARED[name]}" + "".join(f"; {e}" for e in extra) + \
        "; inputs unchanged"


def _merge_answer(fn, case):
    args, _ = merge_inputs(case)
    given = [a.clone() for a in args]
    result = graded_call(_refusal(MERGE), MERGE, fn, *given)
    require_plain(f"{MERGE} ({describe_case(case)})", result)
    return {"result": result, "given": [digest(g) for g in given]}


def _merge_verdict(case, answer) -> str | None:
    """Judged (minidist.checks.kit.docket): the reference merge is computed here, from the case alone."""
    label, result = f"{MERGE} ({describe_case(case)})", answer["result"]
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"{label}: must return (out, lse), got {type(result).__name__}"
    args, (want_out, want_lse) = merge_inputs(case)
    # out = w_a·out_a + w_b·out_b with w = exp(lse_x - lse): a correct merge that rounds lse
    # (e.g. through logaddexp) first moves each weight by up to ulp(lse), relative
    top = max(a.abs().max().item() for a in (args[1], args[3]))
    rounding = 2 * torch.finfo(case["dtype"]).eps * top * max(a.abs().max().item() for a in (args[0], args[2]))
    problem = (err("out", result[0], want_out, slack=rounding, dtype=case["dtype"])
               or err("lse", result[1], want_lse, dtype=case["dtype"]) or unchanged(answer["given"], args))
    if problem:
        finite = all(torch.isfinite(r).all() for r in result if isinstance(r, torch.Tensor))
        big = f" (lse's reach {top:.0f} here: does an exp overflow?)" if top > 80 and not finite else ""
        return f"{label}: {problem}{big}"
    return None


MERGE = "merge_partial_attention"
#: every graded function's verdicts, given again by the grader's judge: the merge's per case, the
#: others' per (case, rank)
JUDGED = Judged.of_functions(__name__, "check_function", {
    MERGE: (merge_cases, _merge_verdict),
    **{name: judged_on_ranks(name, lambda hidden, name=name: _cases(name, hidden), runner, WORLD)
       for name, runner in CASE_RUNNERS.items()}})


@judged(JUDGED)
@passes_quietly
def check_function(name: str, fn, hidden: bool = False, timeout: float = CP_CHECK_TIMEOUT) -> None:
    """Lab 6's graded function ``name``: on 4 ranks cut into groups of t (visible t = 2, 4; hidden
    1, 2, 3, 4), inputs on ``minidist.device()``, output (its dtype exactly) and gradients equal
    fp64 attention of the whole sequence on the CPU, the caller's tensors unchanged, communication
    equals the cost model; the merge in this process. The ring's visible cases include one with
    every isend/irecv blocking. Hidden cases: other dims, fp64 and bf16, GQA and MQA, scores far
    past exp's range, query or only kv heads that do not split, more blocking runs, a late peer
    (the ring's first block computed before the late message can land), sequences that do not cut
    into 2P chunks. Prints the ✓ line when it passes."""
    if name == MERGE:
        JUDGED.run(dict(name=name, hidden=hidden), lambda case: _merge_answer(fn, case))
        return report_passed(name, _covered(name, merge_cases(hidden), hidden), hidden)
    cases = _cases(name, hidden)
    out = launch_named(_body, WORLD, fn, name, cases, name=name, timeout=timeout, refuse=_refusal(name))
    raise_first_group_problem(name, cases, out, WORLD, JUDGED, dict(name=name, hidden=hidden))
    report_passed(name, _covered(name, cases, hidden), hidden)


# ----------------------------------------------------------------------------- measurements (demo cells)
def _measure_body(progress, ulysses_attention, ring_attention_forward, zigzag_shard, ts, seq):
    groups = consecutive_groups(ts, WORLD)
    rows = []
    for t in ts:
        group, r, size = groups[t]
        mark_case(progress, f"t={t}")
        full = [randn((B, seq, H, D), 50 + i, F32) for i in range(3)]
        q, k, v = (on_rank(part(x, 1, r, size)) for x in full)
        with one_thread():
            with trace() as tu:
                ulysses_attention(q, k, v, True, group)
            with trace() as tr:
                ring_attention_forward(q, k, v, True, group)
            positions = {"contiguous": part(torch.arange(seq, device="cpu"), 0, r, size),
                         "zigzag": zigzag_shard(on_rank(torch.arange(seq, device="cpu"))[None], group)[0]}
        rows.append(dict(t=size, rank=r, ulysses_bytes=sum(e.nbytes for e in tu.comm()),
                         ring_bytes=sum(e.nbytes for e in tr.comm() if e.is_send),
                         ring_work=sum(e.meta.get("unmasked", 0) for e in tr.events if e.op == "span:attention block"),
                         **{f"{k}_work": int((p + 1).sum()) * B * H for k, p in positions.items()}))
    return rows


@passes_quietly
def measure(ulysses_attention, ring_attention_forward, zigzag_shard, ts=(1, 2, 4), seq: int = 48,
            timeout: float = CP_CHECK_TIMEOUT) -> list[dict]:
    """On 4 ranks, for each group size t (causal, fp32, b=2, h=12, d=4, sequence ``seq``): bytes
    each rank sent in one forward of your Ulysses (all-to-all inputs) and your ring (isends), next
    to ``minidist.cost.context_parallel``; and per rank the causal attention work (unmasked scores,
    over all batches and heads) that your ring's blocks did (from the helper's trace spans), with
    contiguous shards and with your zigzag shards (counted from the positions you return), next to
    ``cost.causal_scores``. One row per (t, rank of group 0)."""
    out = launch_named(_measure_body, WORLD, ulysses_attention, ring_attention_forward, zigzag_shard, tuple(ts),
                       seq, name="measure", timeout=timeout)
    rows = []
    for t in ts:
        for rank_rows in out[:t]:            # group 0 is ranks 0..t-1
            row = next(x for x in rank_rows if x["t"] == t)
            fwd = lambda colls: sum(c.nbytes for c in colls if c.phase == "forward")     # noqa: E731
            row["ulysses_theory"] = fwd(cost.ulysses_collectives(B, seq, H, D, t))
            row["ring_theory"] = fwd(cost.ring_attention_messages(B, seq, H, D, t))
            for layout in ("contiguous", "zigzag"):
                row[f"{layout}_formula"] = cost.causal_scores(seq, t, layout == "zigzag")[row["rank"]] * B * H
            rows.append(row)
    return rows
