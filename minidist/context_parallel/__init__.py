"""Context (sequence) parallelism for attention: DeepSpeed-Ulysses and ring attention.

Jacobs et al. 2023, "DeepSpeed Ulysses"; Liu et al. 2023, "Ring Attention with Blockwise
Transformers"; Brandon et al. 2023, "Striped Attention" (load-balanced causal shards).
Every rank holds a shard of the sequence, (batch, s/P, heads, head_dim), and attention,
the one op that mixes tokens, is computed without any rank holding the whole sequence's
scores. Read in this order, each file top to bottom:

* ``kernel``: attention of one query block against one key block, returning the
  log-sum-exp; causal masks from global positions; its recompute-from-LSE backward;
* ``merge``: :func:`merge_partial_attention`, the numerically stable LSE merge;
* ``all_to_all``: the differentiable all-to-all (scatter one dim, gather another);
* ``ulysses``: :func:`ulysses_attention`: sequence-sharded → head-sharded and back
  (4 all-to-alls forward, 4 backward), GQA split or replicated;
* ``zigzag``: which tokens a rank holds (contiguous or zigzag), global positions;
* ``ring``: :func:`ring_attention`: K/V blocks round the ring with isend/irecv, causal
  and zigzag, backward with dK/dV travelling home;
* ``hybrid``: :func:`hybrid_attention`, 2D: Ulysses inside a group, the ring across groups.

Everything takes a ``group`` (``None``: the whole world), so it runs in a sub-group of a
mesh. Costs: ``minidist.cost.context_parallel`` (bytes per rank, per-rank causal work).
"""
from minidist.context_parallel.all_to_all import all_to_all
from minidist.context_parallel.hybrid import hybrid_attention, hybrid_shard, new_hybrid_groups
from minidist.context_parallel.kernel import local_attention, visible_window
from minidist.context_parallel.merge import merge_partial_attention
from minidist.context_parallel.ring import ring_attention
from minidist.context_parallel.ulysses import heads_to_seq, kv_heads_per_rank, seq_to_heads, ulysses_attention
from minidist.context_parallel.zigzag import shard, shard_positions, unshard, zigzag_shard

__all__ = ["all_to_all", "local_attention", "visible_window", "merge_partial_attention", "ring_attention",
           "seq_to_heads", "heads_to_seq", "kv_heads_per_rank", "ulysses_attention",
           "shard", "shard_positions", "unshard", "zigzag_shard", "hybrid_attention", "hybrid_shard",
           "new_hybrid_groups"]
