"""Data parallelism with a parameter server (Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server", OSDI).

Workers push their gradients to one server, which sums, averages, takes the optimizer step
and sends the parameters back: point-to-point and lopsided, each worker moves Ψ per step
while the server moves (N−1)·Ψ each way — the bottleneck that all-reduce removes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.collectives.p2p import group_info
from minidist.data_parallel.common import broadcast_module, trainable_parameters

__all__ = ["ParameterServer"]


class ParameterServer:
    """Replicate → split data → compute → push & sum → update → pull.

    Rank ``server`` (in ``group``) computes like everyone else, but also receives every
    worker's flat gradient, averages, takes the optimizer step and sends the new flat
    parameters back. Only the server holds optimizer state (``make_optimizer`` is called
    there only). Traffic is point-to-point and lopsided: each worker sends and receives
    Ψ, the server receives and sends (N−1)·Ψ — the bottleneck that all-reduce removes.
    """

    def __init__(self, module: nn.Module, make_optimizer, group=None, server: int = 0,
                 broadcast_from: int | None = 0):
        self.module, self.group, self.server = module, group, server
        self.rank, self.world_size = group_info(group)
        if not 0 <= server < self.world_size:
            raise ValueError(f"server must be a rank in [0, {self.world_size}), got {server}")
        self.params = trainable_parameters(module)
        self.optimizer = make_optimizer(self.params) if self.rank == server else None
        if broadcast_from is not None:
            broadcast_module(module, broadcast_from, group)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])

    def _unflatten_into(self, flat: torch.Tensor, targets) -> None:
        offset = 0
        for p, t in zip(self.params, targets):
            t.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def step(self) -> None:
        """Push gradients, let the server update, pull parameters. Call after backward."""
        flat = self._flat_grads()
        if self.rank != self.server:
            dist.send(flat, group=self.group, group_dst=self.server)
            dist.recv(flat, group=self.group, group_src=self.server)   # reuse: now parameters
            with torch.no_grad():
                self._unflatten_into(flat, self.params)
            return
        others = [r for r in range(self.world_size) if r != self.server]
        inbox = {r: torch.empty_like(flat) for r in others}
        for work in [dist.irecv(inbox[r], group=self.group, group_src=r) for r in others]:
            work.wait()
        for r in others:              # fixed order: the sum is the same whoever arrives first
            flat += inbox[r]
        flat /= self.world_size
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._unflatten_into(flat, [p.grad for p in self.params])
        self.optimizer.step()
        new = torch.cat([p.detach().reshape(-1) for p in self.params])
        for work in [dist.isend(new, group=self.group, group_dst=r) for r in others]:
            work.wait()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
