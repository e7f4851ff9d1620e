"""Tensor parallelism (Megatron-LM) and sequence parallelism, on real torch.distributed.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism"; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models". Read in this order, each file top to bottom:

* ``comm``: the differentiable collectives, f (:func:`copy_to_tp`) and g
  (:func:`reduce_from_tp`), all-gather / reduce-scatter / split along a dim;
* ``sequence_parallel``: the SP linear that keeps only its input shard, and the partial
  gradients of LayerNorm under SP;
* ``layers``: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding` (and their functional forms);
* ``blocks``: :class:`ParallelMLP`, :class:`ParallelAttention` (split by heads, GQA),
  the dropout :class:`RNGTracker`;
* ``cross_entropy``: :func:`vocab_parallel_cross_entropy`;
* ``transformer``: :func:`tensor_parallel_gpt`, the TP(+SP) version of
  ``minidist.models.TinyGPT``, and :func:`torch_parallelize` (torch's own TP, to compare).

Every function and module takes a ``group`` (``None``: the whole world), so all of it
runs inside a sub-group of a mesh (:func:`new_tp_group`). Costs (bytes per collective,
activation memory) are in :mod:`minidist.cost.tensor_parallel`; saved activations are
measured by :func:`minidist.memory.saved_activation_bytes`.
"""
from minidist.tensor_parallel.blocks import ParallelAttention, ParallelDropout, ParallelMLP, RNGTracker, kv_layout
from minidist.tensor_parallel.comm import (copy_to_tp, gather_along_dim, gather_from_tp, new_tp_group, reduce_from_tp,
                                           reduce_scatter_along_dim, shard_range, split_along_dim, tp_rank, tp_size)
from minidist.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minidist.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             column_parallel_linear, row_parallel_linear)
from minidist.tensor_parallel.sequence_parallel import (SEQ_DIM, gather_from_sequence, mark_sequence_parallel,
                                                        scatter_to_sequence, sequence_parallel_linear,
                                                        sequence_parallel_params, sync_sequence_parallel_grads)
from minidist.tensor_parallel.transformer import (ParallelBlock, ParallelGPT, grads_as_params, max_grad_error,
                                                  tensor_parallel_block, tensor_parallel_gpt, torch_parallelize)

__all__ = [
    # comm
    "copy_to_tp", "reduce_from_tp", "gather_along_dim", "reduce_scatter_along_dim", "split_along_dim",
    "gather_from_tp", "new_tp_group", "tp_rank", "tp_size", "shard_range",
    # layers
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_linear",
    "row_parallel_linear",
    # blocks
    "ParallelMLP", "ParallelAttention", "ParallelDropout", "RNGTracker", "kv_layout",
    # loss
    "vocab_parallel_cross_entropy",
    # sequence parallelism
    "SEQ_DIM", "sequence_parallel_linear", "scatter_to_sequence", "gather_from_sequence", "mark_sequence_parallel",
    "sequence_parallel_params", "sync_sequence_parallel_grads",
    # model
    "ParallelBlock", "ParallelGPT", "tensor_parallel_block", "tensor_parallel_gpt", "torch_parallelize",
    "grads_as_params", "max_grad_error",
]
