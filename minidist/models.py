"""Tiny reference models for the labs and tests.

Shared file: add models, don't restructure. Everything here is deterministic from a
seed, so every rank builds the same model and the same global batch without talking.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- data parallel
class TinyMLP(nn.Module):
    """An MLP with switches for the awkward cases data parallelism must survive.

    ``tied``: the first and last hidden layers share one weight matrix, so its gradient
    arrives in two pieces and must be all-reduced once. ``frozen``: the input bias has
    ``requires_grad=False``. ``unused``: a layer that forward never calls, so its
    parameters get no gradient at all. The default sizes give a parameter count that is
    not divisible by 2, 3 or 4, so sharding needs padding.
    """

    def __init__(self, d_in: int = 6, hidden: int = 13, d_out: int = 5, n_hidden: int = 3,
                 tied: bool = False, frozen: bool = False, unused: bool = False, seed: int = 0):
        super().__init__()
        if n_hidden < (2 if tied else 0):
            raise ValueError("tied=True needs n_hidden >= 2 (the first and last hidden layers share a weight)")
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d_in, hidden)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n_hidden))
        self.out = nn.Linear(hidden, d_out)
        self.unused = nn.Linear(hidden, hidden) if unused else None
        torch.random.set_rng_state(gen_state)   # don't disturb the caller's random stream
        if tied:
            self.hidden[-1].weight = self.hidden[0].weight
        if frozen:
            self.inp.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.out(h)


# The awkward cases every data-parallel implementation must survive, by name: the tests,
# the lab checks and the harness all train these.
TINY_MLP_VARIANTS = {"plain": {}, "tied": {"tied": True}, "frozen": {"frozen": True}, "unused": {"unused": True}}


def describe_mlp(kwargs: dict) -> str:
    """``TinyMLP(tied=True)``: how checks and reports name a model."""
    return "TinyMLP(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"


def mlp_batch(step: int, batch: int, d_in: int = 6, d_out: int = 5, seed: int = 1234):
    """The global batch of training step ``step``: (inputs, regression targets)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """All parameters (each shared tensor once) as one fp32 vector, for equality checks."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])


def local_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of a global batch (how data parallelism splits it)."""
    local = x.shape[0] // world_size
    return x[rank * local:(rank + 1) * local]


def train_reference(model: nn.Module, steps: int, batch: int, lr: float = 1e-2,
                    optimizer: str = "adam", loss_scale: float = 1.0,
                    only_slice: tuple[int, int] | None = None) -> nn.Module:
    """Single-process training on the full batch: the ground truth for every DP variant.

    ``loss_scale`` and ``only_slice=(rank, world_size)`` (train on that rank's slice alone)
    give the usual wrong answers, so a check can say which mistake it is looking at."""
    opt = make_optimizer(model.parameters(), optimizer, lr)
    for step in range(steps):
        x, y = mlp_batch(step, batch, model.inp.in_features, model.out.out_features)
        if only_slice is not None:
            x, y = local_slice(x, *only_slice), local_slice(y, *only_slice)
        (loss_scale * F.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    return model


def make_optimizer(params, name: str = "adam", lr: float = 1e-2) -> torch.optim.Optimizer:
    """The optimizers the DP tests use. Both are elementwise, which is what lets ZeRO shard them."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}: use 'adam' or 'sgd'")


# ----------------------------------------------------------------------------- pipeline parallel
class ResidualMLPBlock(nn.Module):
    """x + W2 tanh(W1 x): keeps the width, so any cut between blocks is a valid pipeline
    stage boundary with the same activation shape (batch, width) everywhere."""

    def __init__(self, width: int, hidden: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden or 2 * width)
        self.fc2 = nn.Linear(hidden or 2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def block_stack(n_blocks: int = 8, width: int = 16, seed: int = 0) -> nn.Sequential:
    """A sequential stack of residual MLP blocks: the model pipeline stages are cut from.
    Same seed, same weights on every rank (the caller's random stream is left alone)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(*(ResidualMLPBlock(width) for _ in range(n_blocks)))
    torch.random.set_rng_state(state)
    return model


def regression_batch(batch: int, width: int, step: int = 0, seed: int = 4321):
    """(inputs, targets), both (batch, width): deterministic, identical on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
