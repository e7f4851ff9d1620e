"""Lab 5's checks (tensor and sequence parallelism, Megatron-LM): each graded function
against one process, forward and backward, and its traced collectives against the cost model.

Shoeybi et al. 2019 (Megatron-LM, Sec. 3: f, g, column/row-parallel layers, heads,
vocab-parallel loss); Korthikanti et al. 2022 (Sec. 4.2.2: sequence parallelism). A lab
test cell is a one-liner::

    checks.check_function("column_parallel_linear", column_parallel_linear)
    checks.check_function("column_parallel_linear", column_parallel_linear, hidden=True)

One launch of 4 ranks per call runs every case: the ranks are cut into tensor-parallel
groups of t consecutive ranks (t = 3 leaves rank 3 alone, a group of one; t = 4 passes
``group=None``, the default group), so every function is run inside sub-groups. A case
compares the output, the input gradient and every parameter gradient with the
single-process module (``minidist.models``, same seed on every rank) within ``TOL``, and,
for t > 1, the collectives traced in forward and in backward with
:mod:`minidist.cost.tensor_parallel` (kind and payload bytes, in any order; in-place or
out-of-place alike). The lab's other functions are stood in for by minidist's own inside
the ranks (the notebook's names are rebound there), so a wrong f costs f's points, not
those of every layer built on it; minidist's implementation of the graded function itself
is refused (:mod:`minidist.checks.kit.launch`). The cases themselves (one runner per kind of
function, judged again by the grader's judge) are in :mod:`minidist.checks.lab5_cases`, their
data and comparisons in :mod:`minidist.checks.lab5_data`.
"""
from __future__ import annotations

import sys

import torch

from minidist import cost
from minidist.checks.kit.launch import check_timeout, launch_named, mark_case, one_thread, report_passed, stand_in_lab_functions
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, judged
from minidist.checks.kit.groups import judged_on_ranks, raise_first_group_problem, run_cases_in_groups
from minidist.checks.lab5_cases import CASE_RUNNERS
from minidist.checks.lab5_data import B, CFG, S, SEQ, WORLD, _dev, _groups, _part, _randn
from minidist.checks.kit.quiet import passes_quietly
from minidist.memory import ActivationMeter
from minidist.models import TinyGPT
from minidist.tensor_parallel.comm import copy_to_tp, gather_along_dim, reduce_from_tp, reduce_scatter_along_dim
from minidist.tensor_parallel.layers import column_parallel_linear, row_parallel_linear
from minidist.trace import trace

TP_CHECK_TIMEOUT = check_timeout(20.0)
_TP = "minidist.tensor_parallel."


def _sp_gather(x, group=None):
    return gather_along_dim(x, SEQ, group)


def _sp_reduce_scatter(x, group=None):
    return reduce_scatter_along_dim(x, SEQ, group)


# The lab's functions that other lab functions call, stood in for by minidist's own in every
# test but their own: (stand-in, minidist names it is, minidist names its backward needs).
# A test allows the other functions' names, never its own function's (f's test refuses CopyToTP).
STAND_INS = {
    "copy_to_tp": (copy_to_tp, ("comm.copy_to_tp", "comm.CopyToTP"), ()),
    "reduce_from_tp": (reduce_from_tp, ("comm.reduce_from_tp", "comm.ReduceFromTP"), ()),
    "column_parallel_linear": (column_parallel_linear, ("layers.column_parallel_linear",), ("comm.CopyToTP",)),
    "row_parallel_linear": (row_parallel_linear, ("layers.row_parallel_linear",), ("comm.ReduceFromTP",)),
    "sp_gather": (_sp_gather, ("comm.gather_along_dim", "comm.GatherAlongDim"), ()),
    "sp_reduce_scatter": (_sp_reduce_scatter, ("comm.reduce_scatter_along_dim", "comm.ReduceScatterAlongDim"), ()),
}
GRADED = ("copy_to_tp", "reduce_from_tp", "column_parallel_linear", "row_parallel_linear", "tp_mlp", "tp_attention",
          "vocab_parallel_cross_entropy", "sp_gather", "sp_reduce_scatter", "sp_mlp_block")

#: minidist.tensor_parallel is refused in graded code; shard_range (where chunk r of n starts and ends) is handed out.
REFUSED = Refusal("tensor and sequence parallelism", ("minidist.tensor_parallel",),
                  allow=(_TP + "comm.shard_range",), checks=__name__)


def _refusal(name: str) -> Refusal:
    own = set(STAND_INS[name][1]) if name in STAND_INS else set()
    allow = [_TP + a for other, (_, names, needs) in STAND_INS.items() if other != name
             for a in names + needs if a not in own]
    return Refusal(REFUSED.technique, REFUSED.modules, REFUSED.allow + tuple(dict.fromkeys(allow)), REFUSED.checks)


def _body(progress, fn, name, cases):
    stand_in_lab_functions(fn, {other: ref for other, (ref, _, _) in STAND_INS.items() if other != name})
    return run_cases_in_groups(progress, CASE_RUNNERS[name], fn, cases, WORLD)


# ----------------------------------------------------------------------------- cases
F32, F64 = torch.float32, torch.float64


BF16 = torch.bfloat16


def _cases(name: str, hidden: bool) -> list[dict]:
    ts = (1, 2, 3, 4) if hidden else (2, 4)
    if name in ("copy_to_tp", "reduce_from_tp"):
        shapes = [((B, S, CFG.d_model), F32)] + ([((5,), F64), ((3, 7), F32), ((4, 6), BF16)] if hidden else [])
        return [dict(t=t, shape=s, dtype=d) for t in ts for s, d in shapes]
    if name in ("column_parallel_linear", "row_parallel_linear"):
        base = dict(d_in=24, d_out=48, bias=True, lead=(B, S), dtype=F32)
        variants = [base] + ([{**base, "bias": False, "lead": (10,)}, {**base, "d_in": 48, "d_out": 12, "dtype": F64}]
                             if hidden else [])
        return [dict(t=t, **v) for t in ts for v in variants]
    if name == "tp_mlp":
        return [dict(t=t) for t in ts] + ([dict(t=4, cfg=dict(d_ff=96)), dict(t=3, dtype=F64)] if hidden else [])
    if name == "tp_attention":
        cases = [dict(t=t) for t in ts]
        if hidden:          # grouped-query attention (t divides n_kv_heads), and heads that do not split
            cases += [dict(t=2, cfg=dict(n_kv_heads=4)), dict(t=4, cfg=dict(n_kv_heads=4)),
                      dict(t=3, cfg=dict(n_kv_heads=3)), dict(t=3, dtype=F64),
                      dict(t=3, cfg=dict(n_heads=4, n_kv_heads=4), raises=True),       # neither splits over 3
                      dict(t=3, cfg=dict(n_kv_heads=4), raises=True)]                  # 12 query heads do, 4 kv do not
        return cases
    if name == "vocab_parallel_cross_entropy":
        base = dict(vocab=48, uneven=False, ignore_index=-100, lead=(B * S,), scale=3.0)
        variants = [base] + ([{**base, "vocab": 50, "uneven": True}, {**base, "ignore_index": 7, "lead": (B, S)},
                              {**base, "scale": 400.0}, {**base, "dtype": F64}] if hidden else [])
        return [dict(t=t, **v) for t in ts for v in variants]
    if name in ("sp_gather", "sp_reduce_scatter"):
        return [dict(t=t) for t in ts] + ([dict(t=t, dtype=d) for t in (2, 3) for d in (F64, BF16)] if hidden else [])
    if name == "sp_mlp_block":
        return [dict(t=t) for t in ts] + ([dict(t=3, dtype=F64)] if hidden else [])
    raise ValueError(f"lab 5 has no graded function {name!r}; graded: {', '.join(GRADED)}")


def _covered(name: str, cases: list[dict]) -> str:
    """What a passing test proved, in a few words (the ✓ line)."""
    ts = ", ".join(str(t) for t in sorted({c["t"] for c in cases}))
    dtypes = "/".join(sorted({str(c.get("dtype", F32)).replace("torch.", "").replace("float", "fp").replace("bfp", "bf")
                              for c in cases}))
    what = "output and gradients vs one process, traffic vs the cost model, inputs untouched"
    if name in ("tp_mlp", "tp_attention", "sp_mlp_block"):
        what += ", two calls per module"
    if any(c.get("raises") for c in cases):
        what += ", ValueError before any message when heads do not split"
    return f"t = {ts}, {dtypes}: {what}"


def _load_dynamo_if_functional_collectives():
    """torch's functional collectives load ``torch._dynamo`` on their first call (seconds of CPU in every
    rank, past a launch's timeout on a busy machine): when the notebook has imported them, load it once
    here, before the ranks are forked, so that they inherit it."""
    if "torch.distributed._functional_collectives" in sys.modules:
        import torch._dynamo  # noqa: F401


#: every graded function's verdicts per (case, rank), given again by the grader's judge
JUDGED = Judged.of_functions(__name__, "check_function", {
    name: judged_on_ranks(name, lambda hidden, name=name: _cases(name, hidden), runner, WORLD)
    for name, runner in CASE_RUNNERS.items()})


@judged(JUDGED)
@passes_quietly
def check_function(name: str, fn, hidden: bool = False, timeout: float = TP_CHECK_TIMEOUT) -> None:
    """Lab 5's graded function ``name`` on 4 ranks cut into groups of t: output, input and
    parameter gradients equal one process; collectives (t > 1) equal the cost model's; the
    caller's tensors unchanged; outputs in the inputs' dtype; a module used twice in a row.
    Visible: t = 2 and 4; hidden: t = 1, 2, 3, 4 and the cases the lab states (no bias,
    2-D and odd shapes, fp64 and bf16, an uneven vocabulary, a custom ignore_index, logits that
    overflow exp without the max, GQA, query or kv heads that do not split)."""
    cases = _cases(name, hidden)
    _load_dynamo_if_functional_collectives()
    out = launch_named(_body, WORLD, fn, name, cases, name=name, timeout=timeout, refuse=_refusal(name))
    raise_first_group_problem(name, cases, out, WORLD, JUDGED, dict(name=name, hidden=hidden))
    report_passed(name, _covered(name, cases), hidden)


# ----------------------------------------------------------------------------- measurements (demo cells)
def _measure_body(progress, tp_mlp, tp_attention, sp_mlp_block, ts):
    groups = _groups(ts)
    rows = []
    for t in ts:
        group, r, size = groups[t]
        mark_case(progress, f"t={t}")
        block = TinyGPT(CFG).blocks[0]                       # on this rank's device
        x = _dev(_randn((B, S, CFG.d_model), 8))
        row = dict(t=size)
        with one_thread():
            for what, fn in (("mlp", tp_mlp), ("attention", tp_attention)):
                module = block.mlp if what == "mlp" else block.attn
                xin = x.clone().requires_grad_()
                with trace() as tr:
                    fn(xin, module, group).sum().backward()
                row[f"{what}_bytes"] = sum(e.nbytes for e in tr.comm())
            for what, run in (("tp", lambda z: z + tp_mlp(block.ln_2(z), block.mlp, group)),
                              ("sp", lambda z: sp_mlp_block(z, block.ln_2, block.mlp, group))):
                xin = (x if what == "tp" else _part(x, SEQ, r, size)).clone().requires_grad_()
                meter = ActivationMeter([*block.parameters(), *block.buffers()])
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                    y = run(xin)
                row[f"{what}_activation_bytes"] = meter.peak_bytes
                del y
        rows.append(row)
    return rows


@passes_quietly
def measure(tp_mlp, tp_attention, sp_mlp_block, ts=(1, 2, 4), timeout: float = TP_CHECK_TIMEOUT) -> list[dict]:
    """On 4 ranks, for each t: payload bytes your tp_mlp and tp_attention communicate in one
    forward and backward (b=2, s=12, h=24), and the activation bytes autograd saves on a rank
    for the MLP half of a block (LayerNorm, MLP, residual) with TP (``x + tp_mlp(ln(x))``)
    and with SP (``sp_mlp_block``), next to ``minidist.cost.tensor_parallel``'s numbers."""
    out = launch_named(_measure_body, WORLD, tp_mlp, tp_attention, sp_mlp_block, tuple(ts), name="measure",
                       timeout=timeout)
    rows = out[0]
    mlp_terms = ("ln_2 input", "ln_2 mean, rstd", "fc input (ln_2 output)", "GeLU input", "proj input (GeLU output)")
    for row in rows:
        t = row["t"]
        row["theory_bytes"] = cost.tp_payload_bytes(cost.tp_layer_collectives(B, S, CFG.d_model, t, sublayers=1))
        for sp in (False, True):
            terms = cost.tp_activation_terms(S, B, CFG.d_model, CFG.n_heads, t, sequence_parallel=sp, d_ff=CFG.d_ff)
            row[f"{'sp' if sp else 'tp'}_activation_formula"] = sum(terms.get(k, 0) for k in mlp_terms)
    return rows
