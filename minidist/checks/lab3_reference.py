"""Lab 3's four functions as the lab's own reference, for the end-to-end checks only.

Each end-to-end test of lab 3 grades one of the student's functions; the lab's other
functions are stood in for by these (inside the ranks, in the notebook's copy there), so
one wrong function costs the points of what it breaks and no more: a wrong
``reduce_scatter_gradients`` fails its own test and ZeRO-2's, not ZeRO-1's step or
ZeRO-3's gather/free. Like minidist's ZeRO, this module is refused while graded code
runs; only the stand-ins of a test's *other* functions are allowed in that test
(:mod:`minidist.checks.lab3_zero_fsdp`). The algorithms are those of
:mod:`minidist.data_parallel.zero` and ``fsdp`` (Rajbhandari et al. 2019), on the lab's
``ShardedUnit``.
"""
from __future__ import annotations

import torch.distributed as dist


def reduce_scatter_gradients(unit):
    """unit.shard.grad += average over ranks of this rank's shard of the unit's flat gradient."""
    flat_grad = unit.layout.flatten([p.grad for p in unit.params], like=unit.shard)
    mine = flat_grad.new_empty(unit.shard.shape)
    dist.reduce_scatter_tensor(mine, flat_grad)
    mine.div_(dist.get_world_size())
    unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
    for p in unit.params:
        p.grad = None


def sharded_step(units, optimizer):
    """Update this rank's shards, then all-gather the full parameters on every rank."""
    optimizer.step()
    for unit in units:
        dist.all_gather_into_tensor(unit.flat, unit.shard.detach().clone())


def gather_parameters(unit):
    """Give the flat parameters their storage back and all-gather every rank's shard into it."""
    unit.flat.untyped_storage().resize_(unit.nbytes)
    dist.all_gather_into_tensor(unit.flat, unit.shard.detach())


def free_parameters(unit):
    """Release the flat parameters' storage (the parameters are views of it; the shard stays)."""
    unit.flat.untyped_storage().resize_(0)


REFERENCES = {f.__name__: f for f in (reduce_scatter_gradients, sharded_step, gather_parameters, free_parameters)}
