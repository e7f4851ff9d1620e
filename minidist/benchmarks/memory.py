"""Bytes per rank of TinyGPT under each precision × ZeRO stage × recomputation policy: modelled vs measured.

For every combination, on ``--world-size`` ranks (ZeRO over all of them): the model states
after backward (16-bit weights and gradients, fp32 masters and Adam moments; live storages,
``ZeroMixedPrecision.state_bytes``) and, from the allocator's own count, every byte the process
holds then (``LiveBytes``), next to :func:`minidist.cost.mixed_precision_memory_bytes`; and
the activations the blocks keep for backward (``ActivationMeter``) next to
:func:`minidist.cost.activation_bytes` (16-bit, no dropout, LayerNorm statistics in 16 bits),
× layers. ``vs_model`` is measured / modelled for the sum; the target is within 5%. Torch is
imported inside :func:`run` (``minidist bench memory --help`` stays fast).
"""
from __future__ import annotations

PRECISIONS = ("bf16", "fp16")
STAGES = (0, 1, 2, 3)
POLICIES = ("none", "selective", "full")


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")


def _measure(cfg: dict, precision: str, stage: int, policy: str, batch: int) -> dict:
    """Inside a rank: two steps; the second one's bytes after backward and its blocks' activations."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from minidist.memory import ActivationMeter, LiveBytes, model_state
    from minidist.memory_techniques import DynamicLossScaler, ZeroMixedPrecision, recompute_blocks, to_low_precision
    from minidist.models import TinyGPT, gpt_batch, gpt_loss

    class Recomputed(nn.Module):
        """TinyGPT's forward with its blocks run by ``recompute_blocks`` (and metered): the root
        module ZeRO wraps, so stage 3 gathers the embeddings and head as in TinyGPT's own forward."""

        def __init__(self, gpt):
            super().__init__()
            self.gpt, self.hooked = gpt, False

        def _exclude(self, module, args):
            """Weights are model state, not activations, wherever ZeRO keeps them now."""
            self.meter.skip |= ActivationMeter(model_state(module)).skip

        def forward(self, ids):
            g = self.gpt
            if not self.hooked:     # registered after ZeRO-3's hooks, so they run once it has gathered
                for m in g.blocks.modules():
                    m.register_forward_pre_hook(self._exclude)
                self.hooked = True
            x = g.drop(g.tok_emb(ids) + g.pos_emb(torch.arange(ids.shape[1], device=ids.device)))
            self.meter = ActivationMeter(model_state(g))
            with self.meter.recording():
                x = recompute_blocks(g.blocks, x, policy)
            self.activations = self.meter.bytes
            return g.lm_head(g.ln_f(x))

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    rank, n = dist.get_rank(), dist.get_world_size()
    live = LiveBytes()
    with live.recording():
        model = Recomputed(to_low_precision(TinyGPT(**cfg), dtype))
        scaler = DynamicLossScaler(2.0 ** 8) if precision == "fp16" else None
        zero = ZeroMixedPrecision(model, stage, scaler=scaler, lr=1e-3)
        for step in range(2):
            ids, tgt = gpt_batch(step * n + rank, batch, cfg["seq_len"], cfg["vocab"])
            zero.scale(gpt_loss(zero(ids), tgt)).backward()
            with live.phase(f"after backward {step}"):
                states = zero.state_bytes()
                time.sleep(0.05)    # gloo's threads free a finished collective's buffers a little later
            taken = zero.step()
            zero.zero_grad()
    return {"states": states, "activations": model.activations, "live": live.held["after backward 1"],
            "taken": taken, "numel": sum(p.numel() for p in TinyGPT(**cfg, device="cpu").parameters())}


def _bench(cfg: dict, batch: int) -> list[dict]:
    return [_measure(cfg, p, s, r, batch) for p in PRECISIONS for s in STAGES for r in POLICIES]


def run(args) -> list[dict]:
    import minidist
    from minidist.cost import activation_bytes, mixed_precision_memory_bytes
    from minidist.runtime import import_optimizers_before_fork
    import_optimizers_before_fork()      # the ranks build optimizers: they inherit the import
    n = args.world_size
    cfg = dict(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq_len=args.seq)
    out = minidist.launch(_bench, n, cfg, args.batch, timeout=600)
    rows, i = [], 0
    for precision in PRECISIONS:
        for stage in STAGES:
            for policy in POLICIES:
                for rank in range(n):
                    r = out[rank][i]
                    states = mixed_precision_memory_bytes(precision, stage, r["numel"], n)["total"]
                    acts = args.layers * activation_bytes(policy, args.seq, args.batch, args.d_model, args.heads,
                                                          elem_bytes=2)
                    measured = r["states"]["total"] + r["activations"]
                    rows.append({"precision": precision, "zero": stage, "recompute": policy, "rank": rank,
                                 "states": r["states"]["total"], "states_model": states,
                                 "live_after_backward": r["live"], "activations": r["activations"],
                                 "activations_model": acts, "measured": measured, "modelled": states + acts,
                                 "vs_model": measured / (states + acts), "live_vs_model": r["live"] / states,
                                 "within_5%": abs(measured / (states + acts) - 1) <= 0.05
                                 and abs(r["live"] / states - 1) <= 0.05})
                i += 1
    return rows
