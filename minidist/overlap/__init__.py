"""Overlapping communication with computation: what separates a fast step from a slow one.

Every parallelism pays for its communication; what it pays in time is the part no computation
hides. With T_comm the α-β time of a transfer and T_overlap the computation that can run while
it travels (computation that does not need its result):

    exposed = max(0, T_comm - T_overlap)         (:mod:`minidist.cost.overlap`)

measured from a run's trace as the time each rank waited on communication
(:mod:`minidist.trace.timeline`). The course's three techniques, each next to its plain version:

* **DDP** (:class:`minidist.data_parallel.BucketedDDP`): a bucket's all-reduce starts from the
  gradient hooks the moment its gradients are ready, while backward goes on (``overlap=False``:
  every bucket launched after backward, the plain version);
* **FSDP / ZeRO-3** (:class:`minidist.data_parallel.FullyShardedDataParallel`, ``prefetch=True``):
  the next unit's all-gather is issued before the current unit computes, forward and backward,
  at the price of one more unit's parameters in memory;
* **asynchronous tensor parallelism** (this package; Wang et al. 2023, "Overlap Communication
  with Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS): the
  all-gather + matmul and matmul + reduce-scatter of sequence-parallel TP decomposed into a ring
  of t point-to-point steps, each chunk's matmul computed while the next chunk travels.

Read in this order:

* ``ring``: the two schedules, all-gather-and-consume and produce-and-reduce-scatter;
* ``all_gather_matmul``: y = all_gather(x_shard) Wᵀ + b, forward and backward as rings
  (plain version: :func:`minidist.tensor_parallel.sequence_parallel_linear`);
* ``matmul_reduce_scatter``: y_shard = reduce_scatter(x Wᵀ), forward and backward as rings
  (plain: :func:`minidist.tensor_parallel.reduce_scatter_along_dim` of ``F.linear``);
* ``symmetric_memory``: torch's fused ops (``torch.ops.symm_mem``), the reference on GPUs that have them.

Why a package of its own rather than inside ``tensor_parallel``: the ring schedules take any
consumer or producer of chunks, not only TP's linears, and the package is where lecture 11's
question, how much communication does computation hide, is answered in code.
"""
from minidist.overlap.all_gather_matmul import AllGatherMatmul, all_gather_matmul
from minidist.overlap.matmul_reduce_scatter import MatmulReduceScatter, matmul_reduce_scatter
from minidist.overlap.ring import neighbours, ring_all_gather_consume, ring_reduce_scatter_produce
from minidist.overlap.symmetric_memory import fused_all_gather_matmul, fused_available, fused_matmul_reduce_scatter

__all__ = ["ring_all_gather_consume", "ring_reduce_scatter_produce", "neighbours",
           "AllGatherMatmul", "all_gather_matmul", "MatmulReduceScatter", "matmul_reduce_scatter",
           "fused_available", "fused_all_gather_matmul", "fused_matmul_reduce_scatter"]
