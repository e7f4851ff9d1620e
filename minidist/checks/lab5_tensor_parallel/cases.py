"""Lab 5's cases (tensor and sequence parallelism): the graded functions, their visible cases (the
hidden ones are the grader's, in ``hidden.py``), the checks' sizes, the inputs every rank and the
verdict draw from seeds, and the ✓ text.

A case is a dict with ``t``, the size of the tensor-parallel group it runs on (4 ranks cut into
blocks of t consecutive ranks: t = 3 leaves rank 3 in a group of one, t = 4 is ``group=None``), and
the settings of that function's case. Group rank s draws its own data from seed ``base + s``, so a
verdict rebuilds any rank's inputs, and a sum over the world (a collective without ``group=``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from minidist.checks.kit.compare import seeded
from minidist.checks.kit.withheld import hidden_cases
from minidist.models import GPTConfig, TinyGPT
from minidist.tensor_parallel.comm import shard_range

WORLD, B, S = 4, 2, 12                 # S divisible by 1, 2, 3 and 4 (sequence shards)
CFG = GPTConfig(vocab=48, d_model=24, n_heads=12, d_ff=48, n_layers=1, seq_len=S)
SEQ = 1                                # activations are (batch, seq, hidden)
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
#: lab 5's relative tolerances where they differ from the kit's (kit.compare.TOLERANCE): fp64 results are
#: held to fp32's 1e-5, as they always were here
TOL = {F64: 1e-5}

GRADED = ("copy_to_tp", "reduce_from_tp", "column_parallel_linear", "row_parallel_linear", "tp_mlp", "tp_attention",
          "vocab_parallel_cross_entropy", "sp_gather", "sp_reduce_scatter", "sp_mlp_block")
MODULES = ("tp_mlp", "tp_attention", "sp_mlp_block")        # called twice in a row on the same module


def function_cases(name: str, hidden: bool) -> list[dict]:
    """The cases of graded function ``name``. Visible: t = 2 and 4; hidden: t = 1, 2, 3, 4 and the
    cases the lab states (no bias, 2-D and odd shapes, fp64 and bf16, an uneven vocabulary, a custom
    ignore_index, logits that overflow exp without the max, GQA, heads that do not split)."""
    if name not in GRADED:
        raise ValueError(f"lab 5 has no graded function {name!r}; graded: {', '.join(GRADED)}")
    h = hidden_cases(__package__, name) if hidden else None
    ts = h.TS if hidden else (2, 4)
    if name in ("copy_to_tp", "reduce_from_tp"):
        shapes = [((B, S, CFG.d_model), F32)] + (h.F_G_SHAPES if hidden else [])
        return [dict(t=t, shape=s, dtype=d) for t in ts for s, d in shapes]
    if name in ("column_parallel_linear", "row_parallel_linear"):
        base = dict(d_in=24, d_out=48, bias=True, lead=(B, S), dtype=F32)
        variants = [base] + ([{**base, **v} for v in h.LINEAR] if hidden else [])
        return [dict(t=t, **v) for t in ts for v in variants]
    if name == "vocab_parallel_cross_entropy":
        base = dict(vocab=48, uneven=False, ignore_index=-100, lead=(B * S,), scale=3.0)
        variants = [base] + ([{**base, **v} for v in h.CROSS_ENTROPY] if hidden else [])
        return [dict(t=t, **v) for t in ts for v in variants]
    # tp_mlp, tp_attention, sp_gather, sp_reduce_scatter, sp_mlp_block: one case per t, then the hidden ones
    return [dict(t=t) for t in ts] + VISIBLE_MORE.get(name, []) + (h.MORE[name] if hidden else [])


#: visible cases after one per t: attention's ValueError before any message, where the 12 query heads
#: split over t = 4 and the 6 kv heads do not (a check of the query heads alone passes it)
VISIBLE_MORE = {"tp_attention": [dict(t=4, cfg=dict(n_kv_heads=6), raises=True)]}


def covered(name: str, hidden: bool) -> str:
    """What a passing test proved, in a few words (the ✓ line), from the cases that ran."""
    cases = function_cases(name, hidden)
    ts = ", ".join(str(t) for t in sorted({c["t"] for c in cases}))
    dtypes = "/".join(sorted({str(c.get("dtype", F32)).replace("torch.", "").replace("float", "fp").replace("bfp", "bf")
                              for c in cases}))
    what = "output and gradients vs one process, traffic vs the cost model, inputs untouched"
    if name in MODULES:
        what += ", two calls per module"
    if any(c.get("raises") for c in cases):
        what += ", ValueError before any message when heads do not split"
    return f"t = {ts}, {dtypes}: {what}"


# ----------------------------------------------------------------------------- inputs (CPU, from seeds)
def part(x, dim, r, t):
    """Rank r's chunk of t along ``dim`` (``tensor_split`` order, as the lab shards)."""
    return x.tensor_split(t, dim=dim)[r]


def f_g_inputs(name: str, case: dict, t: int) -> dict:
    """f: a replicated input and each rank's own upstream gradient; g: each rank's own input and one
    upstream gradient. ``base``: the seed of group rank 0's own tensor."""
    shape, dtype = case["shape"], case["dtype"]
    if name == "copy_to_tp":
        return dict(x=seeded(shape, 1, dtype), ups=[seeded(shape, 100 + s, dtype) for s in range(t)], base=100)
    return dict(xs=[seeded(shape, 200 + s, dtype) for s in range(t)], up=seeded(shape, 7, dtype), base=200)


def sp_inputs(name: str, case: dict, t: int) -> dict:
    """The full activation (b, s, h); for the gather each rank's partial gradient, for the
    reduce-scatter each rank's partial sum and the upstream gradient."""
    dtype = case.get("dtype", F32)
    full = seeded((B, S, CFG.d_model), 21, dtype)
    if name == "sp_gather":
        return dict(full=full, ups=[seeded(full.shape, 300 + s, dtype) for s in range(t)])
    return dict(full=full, xs=[seeded(full.shape, 400 + s, dtype) for s in range(t)], up=seeded(full.shape, 22, dtype))


def linear_layer(case: dict):
    """The single-process layer (torch's init from seed 3), its input and the upstream gradient of its
    output (seeds 4, 5)."""
    d_in, d_out, dtype = case["d_in"], case["d_out"], case["dtype"]
    torch.manual_seed(3)
    lin = nn.Linear(d_in, d_out, bias=case["bias"], dtype=dtype, device="cpu")
    return lin, seeded((*case["lead"], d_in), 4, dtype), seeded((*case["lead"], d_out), 5, dtype)


def linear_cuts(name: str, r: int, t: int) -> dict:
    """Rank r's piece of each tensor: column-parallel splits the weight's rows (and the bias, the
    output); row-parallel the weight's columns (and the input)."""
    column, whole = name == "column_parallel_linear", (lambda v: v)
    last = lambda v: part(v, -1, r, t)                          # noqa: E731
    return {"x": whole if column else last, "out": last if column else whole,
            "weight": lambda v: part(v, 0 if column else 1, r, t),
            "bias": (lambda v: part(v, 0, r, t)) if column else whole}


def ce_inputs(case: dict, t: int):
    """Logits (scaled: 400 overflows exp without the max) and targets that hit the first and last id
    of every shard, with every fifth of the rest ``ignore_index``."""
    vocab, ignore, lead = case["vocab"], case["ignore_index"], case["lead"]
    logits = case["scale"] * seeded((*lead, vocab), 11, case.get("dtype", F32))
    target = torch.randint(0, vocab, lead, generator=torch.Generator().manual_seed(12), device="cpu").flatten()
    bounds = sorted({b for rr in range(t) for b in shard_range(vocab, rr, t)} - {vocab})
    target[:len(bounds)] = torch.tensor(bounds, device="cpu")              # first id of every shard
    target[len(bounds):2 * len(bounds)] = torch.tensor([b - 1 for b in bounds[1:]] + [vocab - 1], device="cpu")  # last
    target[2 * len(bounds)::5] = ignore
    return logits, target.view(lead)


def module_inputs(name: str, case: dict):
    """(config, the single-process MLP or attention of a TinyGPT block, its input leaf, the upstream gradient)."""
    cfg = dataclasses.replace(CFG, **case.get("cfg", {}))
    dtype = case.get("dtype", F32)
    block = TinyGPT(cfg, device="cpu").blocks[0].to(dtype)
    ref = block.mlp if name == "tp_mlp" else block.attn
    return cfg, ref, seeded((B, S, cfg.d_model), 8, dtype).requires_grad_(), seeded((B, S, cfg.d_model), 9, dtype)


def heads_split(cfg: GPTConfig, t: int) -> bool:
    """Attention splits by whole heads: both the query and the key/value heads must divide by t."""
    return not (cfg.n_heads % t or cfg.n_kv_heads % t)


def sp_block_inputs(case: dict):
    """(LayerNorm, MLP) of a TinyGPT block, the full input and the upstream gradient (b, s, h)."""
    dtype = case.get("dtype", F32)
    block = TinyGPT(CFG, device="cpu").blocks[0].to(dtype)
    return block.ln_2, block.mlp, seeded((B, S, CFG.d_model), 31, dtype), seeded((B, S, CFG.d_model), 32, dtype)
