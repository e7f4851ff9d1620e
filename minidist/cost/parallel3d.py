"""Cost of 3D parallelism (DP × PP × TP): bytes per axis per step, memory per rank.

Narayanan et al. 2021 (Megatron-LM, PTD-P), Sec. 3; composed from the per-axis
formulas, nothing re-derived here:

* TP: :func:`minidist.cost.tensor_parallel.tp_gpt_collectives` for this stage's layers and
  ends (embedding on stage 0, head and loss on the last), once per micro-batch of b = B/(d·m)
  sequences; under SP, one all-reduce of the LayerNorms' partial grads per step;
* PP: one (b, s, h) activation (SP: (b, s/t, h)) forward and its gradient backward per
  micro-batch and stage boundary: m isends and m irecvs each way;
* DP: one all-reduce of the stage's gradients per step (2(d-1)/d·Ψ_stage on the wire);
* the loss report: one 8-byte all-reduce over PP and one over DP.

Memory per rank: model states from :func:`minidist.cost.data_parallel.zero_memory_bytes`
with Ψ the stage's parameters on this rank (:func:`stage_numel`); activations = the
schedule's in-flight micro-batches (:func:`minidist.cost.pipeline.pipeline_peak_activations`:
GPipe m, 1F1B p - stage) × one micro-batch's bytes for this stage
(:func:`minidist.cost.tensor_parallel.tp_activation_bytes` per layer, plus the two ends,
counted term by term below and measured exactly by ``minidist.memory.ActivationMeter``).
"""
from __future__ import annotations

from minidist.cost.data_parallel import zero_memory_bytes
from minidist.cost.pipeline import pipeline_peak_activations
from minidist.cost.tensor_parallel import TPCollective, tp_activation_bytes, tp_gpt_collectives

ID_BYTES = 8            # int64 token ids and indices
LOSS_BYTES = 8          # the float64 one-number loss report (minidist.mesh.LOSS_DTYPE)


def _layers(n_layers: int, pp: int) -> int:
    if n_layers % pp:
        raise ValueError(f"{n_layers} layers do not split into pp={pp} equal stages")
    return n_layers // pp


def stage_numel(cfg, pp: int, tp: int, stage: int) -> int:
    """Parameters one TP rank of pipeline stage ``stage`` holds (``cfg``: a ``GPTConfig``).

    Per layer: two LayerNorms (2h each, replicated), Q/K/V/fc column-split (rows and bias
    / t), o and proj row-split (weight / t, bias whole); stage 0 adds the vocab-split token
    embedding and the replicated position embedding, the last stage ln_f and the LM head."""
    h, f, v, s, t = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.seq_len, tp
    if cfg.n_heads % t or cfg.n_kv_heads % t or f % t or v % t:
        raise ValueError(f"heads ({cfg.n_heads}, kv {cfg.n_kv_heads}), d_ff={f} and vocab={v} must be divisible "
                         f"by tp={t}")
    bias = 1 if cfg.bias else 0
    kv = cfg.n_kv_heads * cfg.head_dim
    layer = (4 * h + (h + bias) * h // t + 2 * (h + bias) * kv // t + h * h // t + bias * h
             + (h + bias) * f // t + f * h // t + bias * h)
    out = _layers(cfg.n_layers, pp) * layer
    if stage == 0:
        out += v // t * h + s * h
    if stage == pp - 1:
        out += 2 * h + v // t * h
    return out


def embedding_activation_bytes(tokens: int, seq: int, tp: int, *, sequence_parallel: bool = False) -> int:
    """Saved by stage 0's embedding for one micro-batch: the (shifted) ids, the "another
    rank's id" mask (t > 1), the position ids (unless SP slices the table instead)."""
    return tokens * ID_BYTES + (tokens if tp > 1 else 0) + (0 if sequence_parallel else seq * ID_BYTES)


def head_activation_bytes(tokens: int, d_model: int, vocab: int, tp: int, *, sequence_parallel: bool = False,
                          elem_bytes: int = 4) -> int:
    """Saved by the last stage's ln_f, LM head and vocab-parallel loss for one micro-batch:
    ln_f's input and (mean, rstd), the head's input (SP: shards), the softmax over this
    rank's vocabulary, target index, two bool masks, and the token count the mean divides by."""
    sh = tokens * d_model * elem_bytes // (tp if sequence_parallel else 1)
    stats = 2 * tokens * elem_bytes // (tp if sequence_parallel else 1)
    return 2 * sh + stats + tokens * vocab // tp * elem_bytes + tokens * (ID_BYTES + 2) + ID_BYTES


def stage_activation_bytes(cfg, micro_batch: int, pp: int, tp: int, stage: int, *, sequence_parallel: bool = False,
                           elem_bytes: int = 4, recompute: bool = False) -> int:
    """Bytes one micro-batch leaves saved for backward on one TP rank of ``stage``.
    ``recompute`` (full activation recomputation): a layer keeps only its input."""
    b, s, h = micro_batch, cfg.seq_len, cfg.d_model
    shard = tp if sequence_parallel else 1
    per_layer = (b * s * h * elem_bytes // shard if recompute else
                 tp_activation_bytes(s, b, h, cfg.n_heads, tp, sequence_parallel=sequence_parallel, d_ff=cfg.d_ff,
                                     dropout=cfg.dropout > 0, elem_bytes=elem_bytes))
    out = _layers(cfg.n_layers, pp) * per_layer
    if stage == 0:
        out += embedding_activation_bytes(b * s, s, tp, sequence_parallel=sequence_parallel)
    if stage == pp - 1:
        out += head_activation_bytes(b * s, h, cfg.vocab, tp, sequence_parallel=sequence_parallel,
                                     elem_bytes=elem_bytes)
    return int(out)


def memory_per_rank(cfg, dp: int, pp: int, tp: int, stage: int, *, batch: int, micro_batches: int,
                    schedule: str = "1f1b", sequence_parallel: bool = False, zero_stage: int = 0,
                    elem_bytes: int = 4, optimizer: str = "adam", recompute: bool = False) -> dict[str, float]:
    """{"params", "grads", "optimizer", "activations", "total"} bytes of one rank of ``stage``.

    Model states: Ψ = :func:`stage_numel`, ZeRO ``zero_stage`` over the d DP ranks, at
    ``elem_bytes`` (the CPU runs keep no master copy: Adam's two moments, k = 2e; SGD with
    momentum, k = e; torch's Adam also keeps a scalar step count per parameter tensor, a few
    bytes each, left out). Activations: in-flight micro-batches × one micro-batch's bytes."""
    if batch % (dp * micro_batches):
        raise ValueError(f"batch {batch} does not split into dp={dp} × m={micro_batches} equal micro-batches")
    numel = stage_numel(cfg, pp, tp, stage)
    k = {"adam": 2 * elem_bytes, "sgd": elem_bytes}[optimizer]
    out = dict(zero_memory_bytes(zero_stage, numel, dp, param_bytes=elem_bytes, grad_bytes=elem_bytes, k=k))
    in_flight = pipeline_peak_activations(schedule, pp, micro_batches, rank=stage)
    out["activations"] = in_flight * stage_activation_bytes(
        cfg, batch // (dp * micro_batches), pp, tp, stage, sequence_parallel=sequence_parallel,
        elem_bytes=elem_bytes, recompute=recompute)
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"]
    return out


def step_collectives(cfg, dp: int, pp: int, tp: int, stage: int, *, batch: int, micro_batches: int,
                     sequence_parallel: bool = False, elem_bytes: int = 4) -> dict[str, list[TPCollective]]:
    """What one rank of ``stage`` issues in one step, by axis: {"tp", "pp", "dp"} lists of
    (phase, traced op, payload bytes), payloads as ``minidist.trace`` records them."""
    m = micro_batches
    if batch % (dp * m):
        raise ValueError(f"batch {batch} does not split into dp={dp} × m={m} equal micro-batches")
    b, s, h = batch // (dp * m), cfg.seq_len, cfg.d_model
    first, last = stage == 0, stage == pp - 1
    per_mb = tp_gpt_collectives(b, s, h, _layers(cfg.n_layers, pp), tp, sequence_parallel=sequence_parallel,
                                elem_bytes=elem_bytes, embedding=first, head=last)
    tp_list = [c for c in per_mb if c.phase != "sync"] * m + [c for c in per_mb if c.phase == "sync"]
    act = b * s * h * elem_bytes // (tp if sequence_parallel else 1)
    pp_list = []
    if not last:
        pp_list += [TPCollective("forward", "isend", act), TPCollective("backward", "irecv", act)] * m
    if not first:
        pp_list += [TPCollective("forward", "irecv", act), TPCollective("backward", "isend", act)] * m
    if pp > 1:
        pp_list.append(TPCollective("loss", "all_reduce", LOSS_BYTES))
    numel = stage_numel(cfg, pp, tp, stage)
    dp_list = [TPCollective("step", "all_reduce", numel * elem_bytes), TPCollective("loss", "all_reduce", LOSS_BYTES)]
    return {"tp": tp_list, "pp": pp_list, "dp": dp_list if dp > 1 else []}
