"""Lab 3's reference: the lab's four functions, and its given ``ShardedUnit`` and ``Zero`` built on them.

Each end-to-end test of lab 3 grades the student's functions one stage adds; the lab's other
functions are stood in for by these (inside the ranks, in the notebook's copy of its globals
there), so one wrong function costs the points of what it breaks and no more: a wrong
``reduce_scatter_gradients`` fails its own test and ZeRO-2's, not ZeRO-1's step or ZeRO-3's
gather/free. Like minidist's ZeRO, this module is refused while graded code runs; only the
stand-ins of a test's *other* functions are allowed in that test. :class:`Zero` (on
:class:`ShardedUnit`, both as the notebook gives them) is what the memory check measures before
the student's code, on the same rank. The algorithms are those of :mod:`minidist.data_parallel.zero`
and ``fsdp`` (Rajbhandari et al. 2019).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.data_parallel import FlatShard
from minidist.models import flat_parameters, make_optimizer


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


class ShardedUnit:
    """One module's own trainable parameters as a flat, padded vector; this rank owns one shard."""

    def __init__(self, module, world_size, rank, sharded_params=False):
        self.module = module
        self.params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        self.layout = FlatShard([p.shape for p in self.params], world_size, rank)
        self.flat = self.layout.flatten([p.detach() for p in self.params])
        with torch.no_grad():
            for p, view in zip(self.params, self.layout.views(self.flat)):
                p.data = view                        # the module now reads its weights from self.flat
        shard = self.layout.my_shard(self.flat)
        self.shard = shard.clone() if sharded_params else shard    # what the optimizer updates
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.gathered = True
        self.ready = set()                           # id(p) of params whose gradient is final


# The notebook's Zero(model, stage, optimizer="adam", lr=1e-2): __call__(x), finish_backward() (after
# loss.backward()), step(), zero_grad(), state_tensors() (every parameter-like tensor held), optimizer and
# full_parameters() (flat fp32 vector).
class Zero:
    def __init__(self, model, stage, optimizer="adam", lr=1e-2):
        self.model, self.stage = model, stage
        rank, world = dist.get_rank(), dist.get_world_size()
        modules = [m for m in model.modules()
                   if any(p.requires_grad for p in m.parameters(recurse=False))]
        self.units = [ShardedUnit(m, world, rank, sharded_params=(stage == 3)) for m in modules]
        self.optimizer = make_optimizer([u.shard for u in self.units], optimizer, lr)
        if stage >= 2:
            for u in self.units:
                for p in u.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad_ready(u, p))
        if stage == 3:
            for u in self.units:
                self._free(u)
                u.module.register_forward_pre_hook(lambda m, args, u=u: self._gather(u))
                u.module.register_forward_hook(lambda m, args, out, u=u: self._after_forward(u, out))

    def __call__(self, x):
        return self.model(x)

    def _gather(self, u):
        if not u.gathered:
            gather_parameters(u)
            u.gathered = True

    def _free(self, u):
        if u.gathered:
            free_parameters(u)
            u.gathered = False

    def _after_forward(self, u, out):
        self._free(u)
        if out.requires_grad:
            out.register_hook(lambda grad, u=u: self._gather(u))     # backward reaches this unit

    def _grad_ready(self, u, p):
        u.ready.add(id(p))
        if len(u.ready) == len(u.params):
            reduce_scatter_gradients(u)
            if self.stage == 3:
                self._free(u)

    def finish_backward(self):
        """Call after loss.backward(): units not reduced yet (stage 1; unused parameters) are."""
        for u in self.units:
            if self.stage == 1 or len(u.ready) < len(u.params):
                reduce_scatter_gradients(u)
            if self.stage == 3:
                self._free(u)
            u.ready = set()

    def step(self):
        if self.stage == 3:
            self.optimizer.step()
        else:
            sharded_step(self.units, self.optimizer)

    def zero_grad(self):
        for u in self.units:
            u.shard.grad = None
            for p in u.params:
                p.grad = None

    def state_tensors(self):
        """Every parameter-like tensor this rank holds (for memory accounting)."""
        return list(self.model.parameters()) + [u.shard for u in self.units]

    def full_parameters(self):
        if self.stage == 3:
            with torch.no_grad():
                for u in self.units:
                    self._gather(u)
        params = flat_parameters(self.model)
        if self.stage == 3:
            for u in self.units:
                self._free(u)
        return params
