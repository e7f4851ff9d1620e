"""Cost models, one module per technique: every formula the course uses, written once.

* ``collectives``: α-β-γ time of every all-reduce, the lecture's table, exact bytes per
  rank, nccl-tests bandwidths, fitting α and β;
* ``data_parallel``: wire bytes of DDP / ZeRO / parameter server, ZeRO model-state memory;
* ``pipeline``: bubble fractions and peak activations of the pipeline schedules;
* ``scale``: why distribute: training FLOPs (6·P·D), GPU-years, model bytes;
* ``tensor_parallel``: collectives per Megatron layer (with and without sequence
  parallelism), their α-β time on NVLink and InfiniBand next to the layer's FLOPs,
  activation memory per rank (Korthikanti et al. 2022, and ours term by term);
* ``parallel3d``: DP × PP × TP per rank: parameters of a stage, traffic per axis, memory (``minidist.mesh``);
* ``planner``: every (DP, PP, TP, CP, micro-batch) layout of a cluster ranked by modelled step time (``minidist plan``);
* ``context_parallel``: bytes per rank of Ulysses' all-to-alls and ring attention's block
  passes (MHA, GQA, MQA), both combined (2D), per-rank causal work with contiguous and zigzag shards;
* ``expert_parallel``: bytes per rank of MoE dispatch and combine (forward and backward), load
  imbalance over the expert ranks, their α-β time, MoE MLP FLOPs;
* ``memory_techniques``: bytes per parameter by precision × ZeRO stage × N, activation bytes
  per recomputation policy, recomputation FLOPs, offload traffic (``minidist bench memory``);
* ``checkpoint``: checkpoint bytes per rank per layout, save time at a storage bandwidth, Young's
  (1974) and Daly's (2006) checkpoint intervals, goodput (``minidist plan --mtbf --storage-bw``);
* ``overlap``: exposed communication, max(0, comm - overlappable compute), of bucketed DDP, FSDP
  prefetch (and the memory it costs) and ring collective matmuls (``minidist plan --overlap``).

The names below are the public formulas (``from minidist import cost; cost.pipeline_bubble``).
"""
from minidist.cost.collectives import (ALLREDUCE_ALGORITHMS, BUSBW_FACTOR, Fit, TableRow, algbw,
                                       allreduce_bytes_per_rank, allreduce_table, allreduce_terms,
                                       allreduce_time, busbw, chunk_sizes, fit_alpha_beta, p2p_time,
                                       peak_node_bytes, ring_bytes_nominal, total_bytes)
from minidist.cost.context_parallel import (causal_scores, hybrid_collectives, imbalance, ring_attention_messages,
                                            ring_computed_scores, ulysses_collectives, ulysses_kv_heads)
from minidist.cost.data_parallel import (FP32_ADAM, MIXED_PRECISION_ADAM, largest_model, ring_wire_bytes,
                                         theory_wire_bytes, zero_bytes_per_param, zero_memory_bytes,
                                         zero_memory_bytes_fp32)
from minidist.cost.expert_parallel import (COUNT_BYTES, ep_bytes_per_rank, ep_collectives, ep_comm_time,
                                           ep_layer_collectives, ep_rows, expert_load_imbalance, moe_activation_bytes,
                                           moe_layer_flops, rank_loads)
from minidist.cost.pipeline import (PIPELINE_SCHEDULES, pipeline_bubble, pipeline_bubble_ratio,
                                    pipeline_peak_activations)
from minidist.cost.scale import GPT3_PARAMS, GPT3_TOKENS, PEAK_TFLOPS, gpu_years, model_bytes, training_flops
from minidist.cost.tensor_parallel import (INFINIBAND_NDR, NVLINK_H100, Link, TPCollective, column_parallel_collectives,
                                           kv_replica_collectives, row_parallel_collectives, tp_activation_bytes,
                                           tp_activation_bytes_paper, tp_activation_terms, tp_comm_time,
                                           tp_gpt_collectives, tp_layer_collectives, tp_layer_flops, tp_payload_bytes,
                                           tp_wire_bytes, vocab_parallel_ce_collectives)
from minidist.cost.memory_techniques import (PRECISIONS, activation_bytes, activation_bytes_paper, activation_terms,
                                             layer_forward_flops, mixed_precision_bytes_per_param,
                                             mixed_precision_memory_bytes, offload_memory_bytes,
                                             offload_traffic_bytes, recompute_flops)
from minidist.cost.checkpoint import (checkpoint_bytes_per_rank, daly_interval, flat_shard_elements, goodput, job_mtbf,
                                      save_seconds, young_interval)
from minidist.cost.overlap import (collective_matmul, ddp_exposed, exposed_time, prefetch_exposed,
                                   prefetch_extra_bytes, queued_exposed, ring_bytes, ring_exposed)

__all__ = ["ALLREDUCE_ALGORITHMS", "BUSBW_FACTOR", "Fit", "TableRow", "algbw", "allreduce_bytes_per_rank",
           "allreduce_table", "allreduce_terms", "allreduce_time", "busbw", "chunk_sizes", "fit_alpha_beta",
           "p2p_time", "peak_node_bytes", "ring_bytes_nominal", "total_bytes",
           "FP32_ADAM", "MIXED_PRECISION_ADAM", "largest_model", "ring_wire_bytes", "theory_wire_bytes",
           "zero_bytes_per_param", "zero_memory_bytes", "zero_memory_bytes_fp32",
           "PIPELINE_SCHEDULES", "pipeline_bubble", "pipeline_bubble_ratio", "pipeline_peak_activations",
           "GPT3_PARAMS", "GPT3_TOKENS", "PEAK_TFLOPS", "gpu_years", "model_bytes", "training_flops",
           "TPCollective", "tp_layer_collectives", "tp_gpt_collectives", "column_parallel_collectives",
           "row_parallel_collectives", "kv_replica_collectives", "vocab_parallel_ce_collectives", "tp_payload_bytes",
           "tp_wire_bytes", "tp_activation_bytes_paper", "tp_activation_terms", "tp_activation_bytes",
           "Link", "NVLINK_H100", "INFINIBAND_NDR", "tp_comm_time", "tp_layer_flops",
           "ulysses_collectives", "ulysses_kv_heads", "ring_attention_messages", "causal_scores",
           "ring_computed_scores", "imbalance", "hybrid_collectives",
           "COUNT_BYTES", "ep_rows", "ep_collectives", "ep_layer_collectives", "ep_bytes_per_rank", "rank_loads",
           "expert_load_imbalance", "ep_comm_time", "moe_layer_flops", "moe_activation_bytes"]
__all__ += ["PRECISIONS", "activation_bytes", "activation_bytes_paper", "activation_terms", "layer_forward_flops",
            "mixed_precision_bytes_per_param", "mixed_precision_memory_bytes", "offload_memory_bytes",
            "offload_traffic_bytes", "recompute_flops"]
__all__ += ["checkpoint_bytes_per_rank", "daly_interval", "flat_shard_elements", "goodput", "job_mtbf", "save_seconds",
            "young_interval"]
__all__ += ["collective_matmul", "ddp_exposed", "exposed_time", "prefetch_exposed", "prefetch_extra_bytes",
            "queued_exposed", "ring_bytes", "ring_exposed"]
