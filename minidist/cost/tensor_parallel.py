"""Cost of tensor and sequence parallelism: collectives per layer, activation memory per rank.

Notation (Korthikanti et al. 2022, Table 1): s sequence length, b micro-batch, h hidden
size, a attention heads, t tensor-parallel size; ``d_ff`` the MLP width (4h).

Communication (Shoeybi et al. 2019, "Megatron-LM", Sec. 3). One transformer layer
(attention + MLP) with tensor parallelism: f and g once per sub-block, i.e. 2
all-reduces of the (b, s, h) activation forward and 2 backward. With sequence
parallelism (Korthikanti et al. 2022, Sec. 4.2.2) each all-reduce is split into its
reduce-scatter and all-gather halves: forward 2 all-gathers + 2 reduce-scatters; backward
2 all-gathers (of g's reduce-scatter) + 2 reduce-scatters (of f's all-gather) + 2
all-gathers that re-gather the saved input shard for the weight gradient. Bytes are
*payloads as ``minidist.trace`` records them*: an all-reduce or a reduce-scatter counts
its whole input (bsh elements), an all-gather its input shard (bsh/t). The ring wire
bytes (:func:`tp_wire_bytes`) show the paper's point: RS + AG moves exactly what AR moves.

Time (:func:`tp_comm_time`, :func:`tp_layer_flops`): the α-β model of
:mod:`minidist.cost.collectives` applied to those collectives, on an intra-node link
(NVLink) and an inter-node one (InfiniBand), next to the layer's compute: why t stays
within one node.

Activation memory per layer (Korthikanti et al. 2022, Sec. 4, Eq. 1-4) and the same
count, term by term, for this course's block (:func:`tp_activation_terms`).
"""
from __future__ import annotations

from dataclasses import dataclass

from minidist.cost.data_parallel import ring_wire_bytes


@dataclass(frozen=True)
class TPCollective:
    phase: str      # "forward" or "backward"
    op: str         # the traced op: "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"
    nbytes: int     # payload, as minidist.trace records it


AR, AG, RS = "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"


def _check_t(t: int) -> None:
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"tensor-parallel size must be an int >= 1, got {t!r}")


def tp_layer_collectives(batch: int, seq: int, d_model: int, t: int, *, sequence_parallel: bool = False,
                         elem_bytes: int = 4, sublayers: int = 2) -> list[TPCollective]:
    """Collectives of ``sublayers`` Megatron sub-blocks (2 = attention + MLP = one layer).

    Every sub-block is column-parallel -> row-parallel with a whole-sequence input; a
    group of one rank communicates nothing."""
    _check_t(t)
    if t == 1:
        return []
    full = batch * seq * d_model * elem_bytes
    if not sequence_parallel:
        return [TPCollective("forward", AR, full), TPCollective("backward", AR, full)] * sublayers
    if seq % t:
        raise ValueError(f"sequence parallelism needs seq ({seq}) divisible by t ({t})")
    shard = full // t
    return [TPCollective("forward", AG, shard), TPCollective("forward", RS, full),      # f's gather, g's scatter
            TPCollective("backward", AG, shard),                                        # g's backward
            TPCollective("backward", RS, full), TPCollective("backward", AG, shard),      # f's backward, re-gather
            ] * sublayers


def column_parallel_collectives(tokens: int, in_features: int, out_features: int, t: int, *,
                                gather_output: bool = False, input_grad: bool = True,
                                elem_bytes: int = 4) -> list[TPCollective]:
    """One ColumnParallelLinear: f (an all-reduce of dX backward) and the optional gather."""
    _check_t(t)
    if t == 1:
        return []
    out = [TPCollective("forward", AG, tokens * out_features // t * elem_bytes)] if gather_output else []
    return out + ([TPCollective("backward", AR, tokens * in_features * elem_bytes)] if input_grad else [])


def row_parallel_collectives(tokens: int, in_features: int, out_features: int, t: int, *,
                             elem_bytes: int = 4) -> list[TPCollective]:
    """One RowParallelLinear with a parallel input: g (an all-reduce of Y forward)."""
    _check_t(t)
    return [] if t == 1 else [TPCollective("forward", AR, tokens * out_features * elem_bytes)]


def kv_replica_collectives(n_kv_heads: int, head_dim: int, d_model: int, t: int, *, bias: bool = True,
                           elem_bytes: int = 4) -> list[TPCollective]:
    """Extra backward all-reduces of attention when kv heads are replicated (n_kv < t):
    one buffer with a slot per kv head for the K/V weight rows, and one for their bias."""
    if t == 1 or n_kv_heads % t == 0:
        return []
    rows = 2 * head_dim * n_kv_heads
    out = [TPCollective("backward", AR, rows * d_model * elem_bytes)]
    return out + ([TPCollective("backward", AR, rows * elem_bytes)] if bias else [])


def vocab_parallel_ce_collectives(tokens: int, t: int, elem_bytes: int = 4) -> list[TPCollective]:
    """Vocab-parallel cross entropy: 3 all-reduces of one number per token (max, target
    logit, sum of exp) forward, nothing backward."""
    _check_t(t)
    return [] if t == 1 else [TPCollective("forward", AR, tokens * elem_bytes)] * 3


def tp_gpt_collectives(batch: int, seq: int, d_model: int, n_layers: int, t: int, *,
                       sequence_parallel: bool = False, elem_bytes: int = 4, embedding: bool = True,
                       head: bool = True) -> list[TPCollective]:
    """One training step of ``minidist.tensor_parallel.ParallelGPT``: vocab-parallel
    embedding (g, or a reduce-scatter under SP), ``n_layers`` layers, the column-parallel
    LM head (f, or SP's gather), the loss; under SP also phase "sync", the one all-reduce
    of the gradients of LayerNorms, row-parallel biases and the position embedding.
    ``embedding`` / ``head`` False: a pipeline stage without that end (``minidist.mesh``)."""
    _check_t(t)
    if t == 1:
        return []
    full = batch * seq * d_model * elem_bytes
    layers = tp_layer_collectives(batch, seq, d_model, t, sequence_parallel=sequence_parallel,
                                  elem_bytes=elem_bytes, sublayers=2 * n_layers)
    loss = vocab_parallel_ce_collectives(batch * seq, t, elem_bytes) if head else []
    if not sequence_parallel:
        return ([TPCollective("forward", AR, full)] * embedding + layers
                + [TPCollective("backward", AR, full)] * head + loss)
    # ln_1, ln_2, o/proj biases per layer; ln_f; pos_emb
    sync = (6 * n_layers + 2 * head + seq * embedding) * d_model * elem_bytes
    return ([TPCollective("forward", RS, full), TPCollective("backward", AG, full // t)] * embedding + layers
            + [TPCollective("forward", AG, full // t), TPCollective("backward", RS, full),
               TPCollective("backward", AG, full // t)] * head + loss + [TPCollective("sync", AR, sync)])


def tp_payload_bytes(collectives: list[TPCollective], phase: str | None = None) -> int:
    """Sum of traced payloads (optionally of one phase): what ``sum(e.nbytes for e in t.comm())`` gives."""
    return sum(c.nbytes for c in collectives if phase is None or c.phase == phase)


def tp_wire_bytes(collectives: list[TPCollective], t: int) -> float:
    """Bytes one rank sends with ring algorithms: 2(t-1)/t·X per all-reduce of X, (t-1)/t·X
    per reduce-scatter of X, (t-1)·shard per all-gather."""
    return sum(ring_wire_bytes(c.op, c.nbytes, t) for c in collectives)


# ============================================================================= time: why TP stays in a node
@dataclass(frozen=True)
class Link:
    """One GPU's link in one direction: latency α (s per message), bandwidth 1/β (bytes/s)."""
    name: str
    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth


# Per GPU and direction, from the vendors' data sheets: H100 SXM NVLink 4, 900 GB/s both
# directions together; a ConnectX-7 NDR NIC per GPU (DGX H100), 400 Gb/s. α is an order of
# magnitude (a few µs for both); at these message sizes the β term decides.
NVLINK_H100 = Link("NVLink 4 (inside a node)", alpha=3e-6, bandwidth=450e9)
INFINIBAND_NDR = Link("InfiniBand NDR, 1 NIC per GPU (across nodes)", alpha=5e-6, bandwidth=50e9)


def tp_comm_time(collectives: list[TPCollective], t: int, link: Link) -> float:
    """α-β seconds of ``collectives`` with ring algorithms on ``t`` ranks joined by ``link``:
    2(t-1) messages per all-reduce, t-1 per all-gather or reduce-scatter, each rank sending
    :func:`~minidist.cost.data_parallel.ring_wire_bytes`. A ring is as fast as its slowest
    link: a group that spans nodes runs at the inter-node link."""
    _check_t(t)
    steps = {AR: 2 * (t - 1), AG: t - 1, RS: t - 1}
    return sum(steps[c.op] * link.alpha + ring_wire_bytes(c.op, c.nbytes, t) * link.beta for c in collectives)


def tp_layer_flops(batch: int, seq: int, d_model: int) -> float:
    """FLOPs of one transformer layer's forward and backward, all ranks together:
    72·b·s·h²·(1 + s/6h) (Narayanan et al. 2021, Sec. 5.1: forward 24bsh² + 4bs²h, backward twice that)."""
    return 72 * batch * seq * d_model ** 2 * (1 + seq / (6 * d_model))


# ============================================================================= activations
def tp_activation_bytes_paper(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022, Eq. 1-4: bytes of activations per layer per rank, 16-bit
    activations, 1-byte dropout masks, LayerNorm statistics ignored:

        no parallelism   sbh (34 + 5as/h)
        TP               sbh (10 + 24/t + 5as/(ht))
        TP + SP          sbh/t (34 + 5as/h)

    34 = 4 (two LayerNorm inputs) + 4 (inputs of QKV and of the first MLP linear) + 4 (Q, K)
    + 2 (V) + 2 (input of the output projection) + 16 (GeLU input and output, 4h wide)
    + 2 (two 1-byte dropout masks); 5as²b = 2as²b (softmax) + as²b (its dropout mask)
    + 2as²b (dropout output). Of the 34, 10 are outside the tensor-parallel region
    (LayerNorm inputs, linear inputs, residual dropout masks): SP divides those by t too.
    """
    _check_t(t)
    sbh, attn = s * b * h, 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def tp_activation_terms(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                        d_ff: int | None = None, dropout: bool = False, elem_bytes: int = 4,
                        mask_bytes: int = 1, stat_bytes: int | None = None) -> dict[str, float]:
    """Bytes autograd saves per rank for one ``minidist`` tensor-parallel GPT block, by term.

    The paper's count redone for ``minidist.models.GPTBlock`` / ``ParallelBlock`` as they
    run (fp32 or fp64 ``elem_bytes``, bool dropout masks, LayerNorm keeping its per-token
    mean and 1/std, each a (b, s) tensor of ``stat_bytes``), and measured exactly by
    ``minidist.memory.saved_activation_bytes``. The first group is outside the
    tensor-parallel region (divided by t only under SP); the second is split by heads or by
    MLP columns (divided by t). With ``dropout=False`` (p = 0) dropout is skipped: no masks,
    and attention keeps only the softmax output. GQA changes nothing: K and V are repeated
    to the query heads before the matmuls, which keep the repeated copies.

    In fp32 with dropout and d_ff = 4h this is sbh(18 + 48/t + 9as/(ht)) + 16sb without SP,
    i.e. the paper's formula with every 2-byte tensor at 4 bytes, plus LayerNorm's stats;
    with ``elem_bytes=2, stat_bytes=0`` it *is* the paper's formula. (The single-process
    ``TinyGPT`` uses ``nn.Dropout``, which on CPU keeps a float mask: ``mask_bytes=4``.)
    """
    _check_t(t)
    d_ff = 4 * h if d_ff is None else d_ff
    stat = elem_bytes if stat_bytes is None else stat_bytes
    e, sbh, sb = elem_bytes, s * b * h, s * b
    outside = 1 / t if sequence_parallel else 1.0
    mask = mask_bytes if dropout else 0
    terms = {
        "ln_1 input": e * sbh * outside,
        "ln_1 mean, rstd": 2 * stat * sb * outside,
        "qkv input (ln_1 output)": e * sbh * outside,
        "attention residual dropout mask": mask * sbh * outside,
        "ln_2 input": e * sbh * outside,
        "ln_2 mean, rstd": 2 * stat * sb * outside,
        "fc input (ln_2 output)": e * sbh * outside,
        "mlp residual dropout mask": mask * sbh * outside,
        "Q, K (for QKᵀ)": 2 * e * sbh / t,
        "softmax output": e * a * s * s * b / t,
        "attention dropout mask": mask * a * s * s * b / t,
        "attention dropout output": (e if dropout else 0) * a * s * s * b / t,
        "V": e * sbh / t,
        "o input (attention output)": e * sbh / t,
        "GeLU input": e * sb * d_ff / t,
        "proj input (GeLU output)": e * sb * d_ff / t,
    }
    return {k: v for k, v in terms.items() if v}


def tp_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, **kwargs) -> float:
    """Sum of :func:`tp_activation_terms`: bytes saved per block per rank."""
    return sum(tp_activation_terms(s, b, h, a, t, **kwargs).values())
