"""Activation recomputation: keep less for backward, compute it again when backward needs it.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (full recomputation, a.k.a.
gradient checkpointing), and Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sec. 5 (selective recomputation). Per transformer layer and rank,
16-bit activations (the paper's Eq. 1-6; :mod:`minidist.cost.memory_techniques` counts this
course's blocks term by term):

    none         sbh (34 + 5as/h)          [TP: sbh (10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 + 5as/h)]
    selective    sbh 34                    the 5as²b of scores, softmax, dropout is recomputed
    full         2 sbh                     only the layer's input is kept [TP+SP: 2sbh/t]

Extra forward FLOPs per layer: selective recomputes QKᵀ and the attention-weighted V,
4bs²h; full recomputes the whole forward, 24bsh² + 4bs²h (d_ff = 4h) — a step goes from 3
forward-equivalents to 4.

:class:`Recompute` is one ``autograd.Function``: forward runs the function without building a
graph and saves only its tensor inputs (what :class:`~minidist.memory.ActivationMeter` then
counts); backward restores the random state the forward saw (the global CPU stream, the
inputs' device streams, and the generators of any dropout module that has its own, such as
:class:`~minidist.tensor_parallel.RNGTracker`'s), runs the function again with a graph, and
backpropagates through it — the same masks, so the result equals no recomputation exactly;
the random state is put back afterwards, so the next step draws what it would have drawn.
Parameters' gradients are accumulated by that inner backward (use ``loss.backward()``).

API:
    y = recompute_blocks(blocks, x, policy)     # "none" | "full" | "selective"
    # blocks: minidist.models.GPTBlock or minidist.tensor_parallel.ParallelBlock (TP, TP+SP)
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import get_device_states, set_device_states

from minidist.models import causal_attention

__all__ = ["POLICIES", "Recompute", "recompute", "recompute_blocks"]

POLICIES = ("none", "selective", "full")


# ----------------------------------------------------------------------------- random state
def _generators(modules) -> list[tuple]:
    """(tracker, region) of every dropout module with its own stream (its generator is made on first use)."""
    out = []
    for m in modules:
        for mod in m.modules():
            tracker = getattr(mod, "tracker", None)
            if tracker is not None and hasattr(tracker, "generator") and getattr(mod, "region", None):
                out.append((tracker, mod.region))
    return out


def _rng_state(sources, tensors):
    """Everything a forward may draw from: the CPU stream, the inputs' device streams, trackers'."""
    device = next((t.device for t in tensors), torch.device("cpu"))
    gens = [tracker.generator(region, device) for tracker, region in sources]
    return torch.get_rng_state(), get_device_states(*tensors), [(g, g.get_state()) for g in gens]


def _set_rng_state(state) -> None:
    cpu, (devices, device_states), gens = state
    torch.set_rng_state(cpu)
    set_device_states(devices, device_states)
    for g, s in gens:
        g.set_state(s)


# ----------------------------------------------------------------------------- the function
class Recompute(torch.autograd.Function):
    """``Recompute.apply(fn, rng_sources, *inputs)``: fn's output, keeping only ``inputs``."""

    @staticmethod
    def forward(ctx, fn, rng_sources, *inputs):
        ctx.fn, ctx.rng_sources = fn, rng_sources
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        ctx.rng = _rng_state(rng_sources, tensors)
        ctx.slots = [isinstance(x, torch.Tensor) for x in inputs]
        ctx.others = [None if s else x for s, x in zip(ctx.slots, inputs)]
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        saved, needs = iter(ctx.saved_tensors), ctx.needs_input_grad[2:]
        inputs = [next(saved).detach().requires_grad_(need) if slot else other
                  for slot, other, need in zip(ctx.slots, ctx.others, needs)]
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        now = _rng_state(ctx.rng_sources, tensors)
        _set_rng_state(ctx.rng)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
            torch.autograd.backward(out, grad)
        finally:
            _set_rng_state(now)
        return (None, None, *(x.grad if isinstance(x, torch.Tensor) else None for x in inputs))


def recompute(fn, *inputs, rng_modules=()):
    """fn(*inputs), recomputed in backward; ``rng_modules``: modules whose own dropout
    generators must replay (the global and device streams always do). When no input needs a
    gradient (the parameters inside ``fn`` still do), an empty anchor tensor that does is added,
    so that autograd calls the backward at all."""
    sources = _generators(rng_modules)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and tensors and not any(t.requires_grad for t in tensors):
        anchor = torch.empty(0, device=tensors[0].device, requires_grad=True)
        return Recompute.apply(lambda *args: fn(*args[:-1]), sources, *inputs, anchor)
    return Recompute.apply(fn, sources, *inputs)


# ----------------------------------------------------------------------------- selective
def _core(attn):
    """Attention's recomputed part: scores, softmax, dropout, weighted V (q, k, v kept)."""
    return lambda q, k, v: causal_attention(q, k, v, attn.future, attn.attn_drop)


def _selective_reference_attention(attn, x):
    """minidist.models.CausalSelfAttention.forward with its core recomputed."""
    b, s, _ = x.shape
    heads = lambda t: t.view(b, s, -1, attn.head_dim).transpose(1, 2)     # noqa: E731
    y = recompute(_core(attn), heads(attn.q(x)), heads(attn.k(x)), heads(attn.v(x)), rng_modules=[attn])
    return attn.resid_drop(attn.o(y.transpose(1, 2).reshape(b, s, -1)))


def _selective_parallel_attention(attn, x):
    """minidist.tensor_parallel.ParallelAttention.forward with its core recomputed."""
    qkv = attn.qkv(x)
    b, s, _ = qkv.shape
    hd = attn.head_dim
    q, k, v = qkv.split([attn.q_local * hd, attn.kv_local * hd, attn.kv_local * hd], dim=-1)
    heads = lambda z: z.view(b, s, -1, hd).transpose(1, 2)     # noqa: E731
    y = recompute(_core(attn), heads(q), heads(k), heads(v), rng_modules=[attn])
    return attn.resid_drop(attn.o(y.transpose(1, 2).reshape(b, s, -1)))


@contextlib.contextmanager
def _selective(blocks):
    """Each block's attention runs with its core recomputed (its forward, swapped on the instance)."""
    swapped = []
    for block in blocks:
        attn = block.attn
        if hasattr(attn, "qkv"):
            attn.forward = types.MethodType(_selective_parallel_attention, attn)
        elif all(hasattr(attn, n) for n in ("q", "k", "v", "o", "future", "attn_drop")):
            attn.forward = types.MethodType(_selective_reference_attention, attn)
        else:
            raise ValueError(f"selective recomputation knows minidist's GPT attention, not {type(attn).__name__}")
        swapped.append(attn)
    try:
        yield
    finally:
        for attn in swapped:
            del attn.forward


# ----------------------------------------------------------------------------- the blocks
def recompute_blocks(blocks, x: torch.Tensor, policy: str = "none") -> torch.Tensor:
    """Run ``blocks`` (an iterable of transformer blocks with ``.attn``) on ``x`` in order.

    ``"none"``: as is; ``"full"``: each block keeps only its input and runs again in backward;
    ``"selective"``: each attention's scores/softmax/dropout run again in backward, the rest is
    kept. Same outputs and gradients as ``"none"`` (dropout replays its masks)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    blocks = list(blocks)
    if not all(isinstance(b, nn.Module) for b in blocks):
        raise ValueError("blocks must be nn.Modules")
    if policy == "none":
        for block in blocks:
            x = block(x)
        return x
    if policy == "full":
        for block in blocks:
            x = recompute(block, x, rng_modules=[block])
        return x
    with _selective(blocks):
        for block in blocks:
            x = block(x)
    return x
