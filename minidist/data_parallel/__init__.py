"""Data parallelism (lectures and labs 2 and 3): replicate, split the batch, sync gradients.

* ``common``: what every wrapper shares (trainable parameters, buckets, flat shards, no_sync);
* ``ddp``: naive DDP and bucketed DDP with overlap; ``parameter_server``;
* ``zero``: ZeRO stages 1 and 2; ``fsdp``: ZeRO stage 3 / FSDP.
"""
from minidist.data_parallel.common import FlatShard, GradSyncWrapper, make_buckets, trainable_parameters
from minidist.data_parallel.ddp import BucketedDDP, NaiveDDP
from minidist.data_parallel.fsdp import FullyShardedDataParallel
from minidist.data_parallel.parameter_server import ParameterServer
from minidist.data_parallel.zero import ZeroDataParallel

__all__ = ["NaiveDDP", "BucketedDDP", "ParameterServer", "ZeroDataParallel", "FullyShardedDataParallel",
           "FlatShard", "GradSyncWrapper", "make_buckets", "trainable_parameters"]
