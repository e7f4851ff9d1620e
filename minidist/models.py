"""Tiny reference models for the labs and tests.

Shared file: add models, don't restructure. Everything here is deterministic from a
seed, so every rank builds the same model and the same global batch without talking.
The MLP models and batches take ``device=`` (default: this rank's, ``minidist.device()``):
they are drawn on the CPU from the seed and then moved, so every device gets the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from minidist.runtime.device import device as rank_device


# ----------------------------------------------------------------------------- data parallel
class TinyMLP(nn.Module):
    """An MLP with switches for the awkward cases data parallelism must survive.

    ``tied``: the first and last hidden layers share one weight matrix, so its gradient
    arrives in two pieces and must be all-reduced once. ``frozen``: the input bias has
    ``requires_grad=False``. ``unused``: a layer that forward never calls, so its
    parameters get no gradient at all. The default sizes give a parameter count that is
    not divisible by 2, 3 or 4, so sharding needs padding. The weights are drawn on the CPU
    (the same on every device), then moved to ``device`` (default: ``minidist.device()``).
    """

    def __init__(self, d_in: int = 6, hidden: int = 13, d_out: int = 5, n_hidden: int = 3,
                 tied: bool = False, frozen: bool = False, unused: bool = False, seed: int = 0,
                 device: torch.device | str | None = None):
        super().__init__()
        if n_hidden < (2 if tied else 0):
            raise ValueError("tied=True needs n_hidden >= 2 (the first and last hidden layers share a weight)")
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        with torch.device("cpu"):               # the CPU generator draws them, whatever the default device
            self.inp = nn.Linear(d_in, hidden)
            self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n_hidden))
            self.out = nn.Linear(hidden, d_out)
            self.unused = nn.Linear(hidden, hidden) if unused else None
        torch.random.set_rng_state(gen_state)   # don't disturb the caller's random stream
        if tied:
            self.hidden[-1].weight = self.hidden[0].weight
        if frozen:
            self.inp.bias.requires_grad_(False)
        self.to(device if device is not None else rank_device())    # .to keeps the tie: one shared tensor

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


def _cpu_randn(g: torch.Generator, device, *shape) -> torch.Tensor:
    """Drawn on the CPU from ``g`` (the same numbers on every device), then moved to ``device``."""
    return torch.randn(*shape, generator=g, device="cpu").to(device if device is not None else rank_device())


def mlp_batch(step: int, batch: int, d_in: int = 6, d_out: int = 5, seed: int = 1234,
              device: torch.device | str | None = None):
    """The global batch of training step ``step``: (inputs, regression targets), on ``device``
    (default: ``minidist.device()``)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return _cpu_randn(g, device, batch, d_in), _cpu_randn(g, device, batch, d_out)


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
    dev = model.inp.weight.device
    for step in range(steps):
        x, y = mlp_batch(step, batch, model.inp.in_features, model.out.out_features, device=dev)
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
    stage boundary with the same activation shape (batch, width) everywhere. Drawn on the CPU
    from the global random stream, then moved to ``device`` (default: ``minidist.device()``)."""

    def __init__(self, width: int, hidden: int | None = None, device: torch.device | str | None = None):
        super().__init__()
        with torch.device("cpu"):
            self.fc1 = nn.Linear(width, hidden or 2 * width)
            self.fc2 = nn.Linear(hidden or 2 * width, width)
        self.to(device if device is not None else rank_device())

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


def block_stack(n_blocks: int = 8, width: int = 16, seed: int = 0,
                device: torch.device | str | None = None) -> nn.Sequential:
    """A sequential stack of residual MLP blocks: the model pipeline stages are cut from.
    Same seed, same weights on every rank and device (the caller's random stream is left alone)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(*(ResidualMLPBlock(width, device=device) for _ in range(n_blocks)))
    torch.random.set_rng_state(state)
    return model


def regression_batch(batch: int, width: int, step: int = 0, seed: int = 4321,
                     device: torch.device | str | None = None):
    """(inputs, targets), both (batch, width) on ``device`` (default: ``minidist.device()``):
    deterministic, identical on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return _cpu_randn(g, device, batch, width), _cpu_randn(g, device, batch, width)


# ----------------------------------------------------------------------------- transformer (labs 5-7)
# A nanoGPT-sized GPT: the single-process reference for tensor, sequence, context and 3D
# parallelism. Attention is written out (no fused kernel) so that what autograd saves is
# the textbook list that Korthikanti et al. 2022 count, and the head count is read from
# the tensors (``view(b, s, -1, head_dim)``) so torch's own tensor parallelism can shard
# the projections of this very module without patching attributes. Modules and batches
# take ``device=`` (default: this rank's, ``minidist.device()``).
@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`TinyGPT`. ``n_kv_heads`` < ``n_heads`` gives grouped-query
    attention (1 = multi-query); ``None`` means ``n_heads``. ``d_ff=None`` means 4·d_model."""
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    n_layers: int = 2
    seq_len: int = 16
    dropout: float = 0.0
    bias: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, kv_heads, s, d) -> (b, kv_heads·n_rep, s, d): query head i reads kv head i // n_rep."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def causal_attention(q, k, v, future: torch.Tensor, dropout=None) -> torch.Tensor:
    """softmax(q kᵀ / √d, future positions masked) v on (batch, heads, seq, head_dim).

    ``k``/``v`` may have fewer heads than ``q`` (GQA). ``future`` is a bool (≥seq, ≥seq)
    upper-triangular buffer; ``dropout`` a callable applied to the probabilities. Shared
    by :class:`TinyGPT` and the tensor-parallel attention, so both run the same arithmetic.
    """
    s = q.size(-2)
    k, v = repeat_kv(k, q.size(1) // k.size(1)), repeat_kv(v, q.size(1) // v.size(1))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    att = att.masked_fill(future[:s, :s], float("-inf")).softmax(dim=-1)
    if dropout is not None:
        att = dropout(att)
    return att @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017), with the head split and merge in view:

        x (b, s, d) --q, k, v--> (b, s, a·h_d) --view--> (b, s, a, h_d) --transpose--> (b, a, s, h_d)
        per head: softmax(q kᵀ / √h_d + causal mask) v                          (b, a, s, h_d)
        merge: transpose --> (b, s, a, h_d) --reshape--> (b, s, a·h_d) --o--> (b, s, d)

    ``a`` heads of ``h_d = d / a`` numbers (``n_kv_heads < a``: grouped-query attention, each k/v head
    shared by ``a / n_kv_heads`` query heads). The heads never mix before ``o``: that is why tensor
    parallelism can give each rank whole heads (lab 5)."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        device = device or rank_device()
        self.head_dim = cfg.head_dim
        linear = lambda i, o: nn.Linear(i, o, bias=cfg.bias, device=device)     # noqa: E731
        self.q = linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.k = linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
        self.v = linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
        self.o = linear(cfg.n_heads * cfg.head_dim, cfg.d_model)
        self.attn_drop, self.resid_drop = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        self.register_buffer("future", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool, device=device).triu(1),
                             persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, -1, self.head_dim).transpose(1, 2)     # noqa: E731
        y = causal_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), self.future, self.attn_drop)
        return self.resid_drop(self.o(y.transpose(1, 2).reshape(b, s, -1)))


class GPTMLP(nn.Module):
    """The block's feed-forward: x (b, s, d) --fc--> (b, s, d_ff) --GELU--> --proj--> (b, s, d), then
    dropout; d_ff = 4d by default. Every token goes through it on its own (no mixing across
    positions), and the GELU acts element by element: fc can be split by columns and proj by
    rows with a single sum at the end (Megatron's MLP, lab 5)."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        device = device or rank_device()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias, device=device)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias, device=device)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(self.act(self.fc(x))))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig, device=None):
        super().__init__()
        device = device or rank_device()
        self.ln_1, self.attn = nn.LayerNorm(cfg.d_model, device=device), CausalSelfAttention(cfg, device)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.d_model, device=device), GPTMLP(cfg, device)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + position embedding, ``n_layers`` pre-LN blocks, final LayerNorm, LM head
    (untied, so pipeline stages can own the two ends separately). ``forward(ids)`` returns
    logits (batch, seq, vocab); :func:`gpt_loss` turns them into the mean cross entropy.
    ``TinyGPT(cfg, n_kv_heads=2)`` overrides fields of ``cfg``; ``TinyGPT(n_layers=4)``
    overrides the defaults.

    Deterministic from ``cfg.seed``, and the caller's random stream is left alone. Every
    parameter is random (biases and LayerNorm affine too, at unit-ish scale): at this
    width a zero bias or a unit LayerNorm weight would hide a bias added twice or a
    LayerNorm gradient left unreduced. The weights are drawn on the CPU and then moved to
    ``device``, so a model is the same numbers on every device.
    """

    def __init__(self, cfg: GPTConfig | None = None, *, device=None, **overrides):
        super().__init__()
        cfg = GPTConfig(**overrides) if cfg is None else replace(cfg, **overrides)
        self.cfg = cfg
        cpu = torch.device("cpu")
        state = torch.random.get_rng_state()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model, device=cpu)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model, device=cpu)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg, cpu) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, device=cpu)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False, device=cpu)
        torch.random.set_rng_state(state)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():     # fixed order: same weights everywhere
                if name.endswith("bias"):
                    p.normal_(0.0, 0.1, generator=g)
                elif "ln" in name:
                    p.normal_(1.0, 0.1, generator=g)
                elif "emb" in name:
                    p.normal_(0.0, 1.0, generator=g)
                else:
                    p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
        self.to(device or rank_device())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence of {s} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.drop(self.tok_emb(ids) + self.pos_emb(torch.arange(s, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy over every (batch, position) not equal to ``ignore_index``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)


def gpt_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 1234, device=None):
    """The global batch of step ``step``: (ids, targets), both (batch, seq) int64, where
    ``targets`` is ``ids`` shifted by one token. Identical on every rank (drawn on the CPU,
    then moved to ``device``, by default this rank's)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g, device="cpu").to(device or rank_device())
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
