"""Collectives rebuilt from send/recv (lecture and lab 1).

* ``p2p``: the building blocks (group ranks, deadlock-free pairwise exchange, chunking);
* ``primitives``: broadcast, reduce, scatter, gather, all-gather, reduce-scatter, all-to-all;
* ``allreduce``: parameter server, naive, parallel, tree, ring, recursive halving/doubling,
  and the pipelined ring.
"""
from minidist.collectives.allreduce import (ALL_REDUCES, fast_ring_all_reduce, naive_all_reduce,
                                            parallel_all_reduce, parameter_server_all_reduce,
                                            recursive_halving_all_reduce, ring_all_reduce, tree_all_reduce)
from minidist.collectives.p2p import exchange, group_info
from minidist.collectives.primitives import (all_gather, all_to_all, broadcast, gather, reduce, reduce_scatter,
                                             scatter)

__all__ = ["broadcast", "reduce", "scatter", "gather", "all_gather", "reduce_scatter", "all_to_all",
           "parameter_server_all_reduce", "naive_all_reduce", "parallel_all_reduce", "tree_all_reduce",
           "ring_all_reduce", "recursive_halving_all_reduce", "fast_ring_all_reduce", "ALL_REDUCES",
           "exchange", "group_info"]
