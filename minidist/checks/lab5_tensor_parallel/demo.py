"""Lab 5's measurements for the notebook's demo cells (not graded): the traffic of the student's
``tp_mlp`` and ``tp_attention``, and the activation bytes autograd saves for the MLP half of a block
with tensor parallelism and with sequence parallelism, next to :mod:`minidist.cost.tensor_parallel`."""
from __future__ import annotations

import torch

from minidist import cost
from minidist.checks.kit.compare import on_rank, seeded
from minidist.checks.kit.groups import consecutive_groups
from minidist.checks.kit.launch import TIMEOUT, launch_named, mark_case, one_thread
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.lab5_tensor_parallel.cases import B, CFG, S, SEQ, WORLD, part
from minidist.memory import ActivationMeter
from minidist.models import TinyGPT
from minidist.trace import trace

#: the terms of cost.tp_activation_terms that the MLP half of a block (LayerNorm, MLP, residual) saves
MLP_TERMS = ("ln_2 input", "ln_2 mean, rstd", "fc input (ln_2 output)", "GeLU input", "proj input (GeLU output)")


def _measure_body(progress, tp_mlp, tp_attention, sp_mlp_block, ts):
    groups = consecutive_groups(ts, WORLD)
    rows = []
    for t in ts:
        group, r, size = groups[t]
        mark_case(progress, f"t={t}")
        block = TinyGPT(CFG).blocks[0]                       # on this rank's device
        x = on_rank(seeded((B, S, CFG.d_model), 8))
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
                xin = (x if what == "tp" else part(x, SEQ, r, size)).clone().requires_grad_()
                meter = ActivationMeter([*block.parameters(), *block.buffers()])
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                    y = run(xin)
                row[f"{what}_activation_bytes"] = meter.peak_bytes
                del y
        rows.append(row)
    return rows


@passes_quietly
def measure(tp_mlp, tp_attention, sp_mlp_block, ts=(1, 2, 4), timeout: float = TIMEOUT) -> list[dict]:
    """On 4 ranks, for each t: payload bytes your tp_mlp and tp_attention communicate in one
    forward and backward (b=2, s=12, h=24), and the activation bytes autograd saves on a rank
    for the MLP half of a block (LayerNorm, MLP, residual) with TP (``x + tp_mlp(ln(x))``)
    and with SP (``sp_mlp_block``), next to ``minidist.cost.tensor_parallel``'s numbers."""
    out = launch_named(_measure_body, WORLD, tp_mlp, tp_attention, sp_mlp_block, tuple(ts), name="measure",
                       timeout=timeout)
    rows = out[0]
    for row in rows:
        t = row["t"]
        row["theory_bytes"] = cost.tp_payload_bytes(cost.tp_layer_collectives(B, S, CFG.d_model, t, sublayers=1))
        for sp in (False, True):
            terms = cost.tp_activation_terms(S, B, CFG.d_model, CFG.n_heads, t, sequence_parallel=sp, d_ff=CFG.d_ff)
            row[f"{'sp' if sp else 'tp'}_activation_formula"] = sum(terms.get(k, 0) for k in MLP_TERMS)
    return rows
