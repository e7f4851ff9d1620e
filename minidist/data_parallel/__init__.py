"""Data parallelism (lectures and labs 2 and 3): replicate, split the batch, sync gradients.

* ``common``: what every wrapper shares (trainable parameters, buckets, flat shards, no_sync);
* ``ddp``: naive DDP and bucketed DDP with overlap; ``parameter_server``;
* ``shard_ops``: what ZeRO does to one flat, padded, sharded parameter vector (reduce-scatter its
  gradients into the shard, all-gather the shards, free and re-gather it, the sharded step);
* ``zero``: ZeRO stages 1 and 2; ``fsdp``: ZeRO stage 3 / FSDP (both built on ``shard_ops``).
"""
from minidist.data_parallel.common import FlatShard, GradSyncWrapper, make_buckets, trainable_parameters
from minidist.data_parallel.ddp import BucketedDDP, NaiveDDP
from minidist.data_parallel.fsdp import FullyShardedDataParallel
from minidist.data_parallel.parameter_server import ParameterServer
from minidist.data_parallel.zero import ZeroDataParallel

__all__ = ["NaiveDDP", "BucketedDDP", "ParameterServer", "ZeroDataParallel", "FullyShardedDataParallel",
           "FlatShard", "GradSyncWrapper", "make_buckets", "trainable_parameters"]
