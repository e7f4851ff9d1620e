"""``minidist tour`` rows for tensor parallelism (Megatron-LM) and sequence parallelism.

Each row runs one forward and backward on 4 CPU ranks (fp32), builds the single-process
module from the same seed on every rank, and reports the largest difference of the
output and of every gradient (max_err), the payload bytes the tracer saw on the busiest
rank next to ``minidist.cost.tensor_parallel`` (bytes_per_rank vs bytes_theory), and
for the blocks the activation bytes autograd saved next to the formula. A row's own
``passed`` says the traced bytes (and, for blocks, the saved bytes) equal theory exactly;
the tour adds the max_err verdict (fp32 tolerance). Inputs are drawn on the CPU (the same
numbers everywhere) and moved to the rank's device, ``minidist.device()``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist import cost
from minidist.memory import saved_activation_bytes
from minidist.models import GPTConfig, TinyGPT
from minidist.runtime import device, launch, timed
from minidist.tensor_parallel import (ColumnParallelLinear, ParallelAttention, ParallelMLP, RowParallelLinear,
                                      grads_as_params, max_grad_error, shard_range,
                                      sync_sequence_parallel_grads, tensor_parallel_block,
                                      vocab_parallel_cross_entropy)
from minidist.tour import TourEntry
from minidist.trace import trace

T = 4
B, S = 2, 16
CFG = GPTConfig(vocab=50, d_model=32, n_heads=8, d_ff=128, n_layers=1, seq_len=S)


def _x(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(device())


def _diff(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _run_pair(ours, ref, x_ours, x_ref, expected, out_of=lambda y: y, in_of=lambda g: g, sync=False):
    """Forward + backward of both with the same upstream gradient: (max_err, traced bytes).

    ``out_of``/``in_of`` cut this rank's part out of the reference's output / input
    gradient; ``expected`` cuts the reference's gradients the way ``ours`` was cut."""
    x_ours.requires_grad_()
    x_ref.requires_grad_()
    y_ref = ref(x_ref)
    w = _x(y_ref.shape, 1)
    (y_ref * w).sum().backward()
    with trace() as t:
        y = ours(x_ours)
        (y * out_of(w)).sum().backward()
        if sync:
            sync_sequence_parallel_grads(ours)
    err = max(_diff(y, out_of(y_ref)), _diff(x_ours.grad, in_of(x_ref.grad)),
              max_grad_error(ours, expected(grads_as_params(ref))))
    return err, sum(e.nbytes for e in t.comm())


def _rank(kind):
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    block = TinyGPT(CFG).blocks[0]
    x = _x((B, S, CFG.d_model))
    if kind == "column":
        lin = nn.Linear(CFG.d_model, CFG.d_ff, device=device())
        return _run_pair(ColumnParallelLinear.from_full(lin, gather_output=True), lin, x.clone(), x.clone(),
                         lambda g: ColumnParallelLinear.from_full(g, gather_output=True))
    if kind == "row":
        lin = nn.Linear(CFG.d_ff, CFG.d_model, device=device())
        x = _x((B, S, CFG.d_ff))
        cols = slice(*shard_range(CFG.d_ff, rank, t))
        return _run_pair(RowParallelLinear.from_full(lin), lin, x[..., cols].clone(), x.clone(),
                         RowParallelLinear.from_full, in_of=lambda g: g[..., cols])
    if kind == "mlp":
        return _run_pair(ParallelMLP.from_full(block.mlp), block.mlp, x.clone(), x.clone(), ParallelMLP.from_full)
    if kind.startswith("attention"):
        attn = TinyGPT(CFG, n_kv_heads=int(kind.split("=")[1])).blocks[0].attn
        return _run_pair(ParallelAttention.from_full(attn), attn, x.clone(), x.clone(), ParallelAttention.from_full)
    if kind == "cross_entropy":
        logits = 3 * _x((B * S, CFG.vocab))
        target = torch.randint(0, CFG.vocab, (B * S,), generator=torch.Generator().manual_seed(2),
                               device="cpu").to(device())
        target[::7] = -100
        start, stop = shard_range(CFG.vocab, rank, t)
        full = logits.clone().requires_grad_()
        ref = nn.functional.cross_entropy(full, target)
        ref.backward()
        mine = logits[:, start:stop].clone().requires_grad_()
        with trace() as tr:
            loss = vocab_parallel_cross_entropy(mine, target, vocab_size=CFG.vocab)
            loss.backward()
        return max(_diff(loss, ref), _diff(mine.grad, full.grad[:, start:stop])), sum(e.nbytes for e in tr.comm())
    sp = kind == "block_sp"
    ours = tensor_parallel_block(block, sequence_parallel=sp)
    shard = (lambda z: z.tensor_split(t, 1)[rank]) if sp else (lambda z: z)
    err, sent = _run_pair(ours, block, shard(x).contiguous(), x.clone(),
                          lambda g: tensor_parallel_block(g, sequence_parallel=sp), out_of=shard, in_of=shard, sync=sp)
    _, saved = saved_activation_bytes(ours, shard(x).contiguous().requires_grad_(), exclude=ours)
    return err, sent, saved


def _theory(kind, t):
    e, d, f = 4, CFG.d_model, CFG.d_ff
    if kind == "column":
        return cost.column_parallel_collectives(B * S, d, f, t, gather_output=True)
    if kind == "row":
        return cost.row_parallel_collectives(B * S, f, d, t)
    if kind == "mlp":
        return cost.tp_layer_collectives(B, S, d, t, sublayers=1)
    if kind.startswith("attention"):
        kv = int(kind.split("=")[1])
        return cost.tp_layer_collectives(B, S, d, t, sublayers=1) + cost.kv_replica_collectives(kv, CFG.head_dim, d, t)
    if kind == "cross_entropy":
        return cost.vocab_parallel_ce_collectives(B * S, t)
    sp = kind == "block_sp"
    sync = [cost.TPCollective("sync", "all_reduce", 6 * d * e)] if sp else []
    return cost.tp_layer_collectives(B, S, d, t, sequence_parallel=sp) + sync


LABELS = {
    "column": "TP column-parallel linear (gathered output)",
    "row": "TP row-parallel linear",
    "mlp": "TP Megatron MLP (column -> GeLU -> row)",
    "attention kv=8": "TP attention split by heads (8 heads)",
    "attention kv=2": "TP attention, GQA 8q/2kv (kv replicated x2)",
    "cross_entropy": "TP vocab-parallel cross entropy (V=50, uneven)",
    "block": "TP transformer block",
    "block_sp": "TP+SP transformer block (sequence parallel)",
}
NOTES = {
    "column": "f: all-reduce of dX backward; gather of Y forward",
    "row": "g: all-reduce of Y forward, bias added after it",
    "mlp": "1 all-reduce forward + 1 backward",
    "attention kv=8": "whole heads per rank; 1 all-reduce forward + 1 backward",
    "attention kv=2": "+2 backward all-reduces summing the kv replicas' gradients",
    "cross_entropy": "3 all-reduces of one number per token forward, none backward",
}


def tour_row(kind: str, world_size: int = T) -> dict:
    with timed() as clock:
        out = launch(_rank, world_size, kind, timeout=120)
    row = {"technique": LABELS[kind], "world_size": world_size, "max_err": max(o[0] for o in out),
           "bytes_per_rank": max(o[1] for o in out),
           "bytes_theory": cost.tp_payload_bytes(_theory(kind, world_size)), "time_s": clock.seconds,
           "note": NOTES.get(kind, "")}
    row["passed"] = row["bytes_per_rank"] == row["bytes_theory"]      # max_err is judged by the tour
    if kind.startswith("block"):
        sp = kind == "block_sp"
        kw = dict(sequence_parallel=sp, d_ff=CFG.d_ff)
        formula = cost.tp_activation_bytes(S, B, CFG.d_model, CFG.n_heads, world_size, **kw)
        paper = cost.tp_activation_bytes_paper(S, B, CFG.d_model, CFG.n_heads, world_size, sp)
        saved = max(o[2] for o in out)
        row |= {"activation_bytes": saved, "activation_formula": formula, "activation_paper_16bit": paper,
                "passed": row["passed"] and saved == formula,
                "note": (f"{'2 AG + 2 RS fwd, 4 AG + 2 RS bwd + LN-grad sync' if sp else '2 AR fwd + 2 bwd'}; "
                         f"saved activations {saved} B vs formula {formula:.0f} B (paper, 16-bit: {paper:.0f} B)")}
    return row


def tour_entries() -> list[TourEntry]:
    return [TourEntry(label, T, lambda k=kind: tour_row(k)) for kind, label in LABELS.items()]
