"""Lab 3's given classes, word for word as the notebook gives them: ``ShardedUnit`` (one module's
parameters as a flat, padded vector and this rank's shard) and ``Zero`` (the wrapper that calls the
lab's four functions at the right moments), here on the library's stand-ins for those functions
(:mod:`~minidist.checks.lab3_zero_fsdp.stand_ins`). The memory check measures this ``Zero``
before the student's, on the same rank (``answers.reference_live``). Refused while graded code runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.checks.lab3_zero_fsdp.stand_ins import (free_parameters, gather_parameters,
                                                               reduce_scatter_gradients, sharded_step)
from minidist.data_parallel import FlatShard
from minidist.models import flat_parameters, make_optimizer


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
