"""Published model architectures for ``minidist plan --model NAME`` (plain numbers: no
torch, no numpy, so ``minidist plan --help`` can list them at once).

Each preset is the paper's numbers: parameters in all, layers, hidden size, attention
heads, training sequence length. The planner (:mod:`minidist.cost.planner`) models every
layer as a GPT layer (12h² weights: multi-head attention and a 4h MLP) and gives the rest of
``params`` to the embedding and LM head. Llama's layers differ (SwiGLU MLP; 70B also has
grouped-query attention with 8 key/value heads, which the planner does not model), so for
the Llama presets the layers' compute and memory are close but the vocabulary the planner
infers is not Llama's 32,000: read their rows as "a GPT of that size and shape".

Mixture-of-Experts presets also give the experts per layer, the experts each token uses
(top-k), the experts' MLP width and their matrices (3: SwiGLU). Mixtral's attention has 8
key/value heads; the planner models it as multi-head attention (and counts biases), so its
``params`` is the 47.5B that model counts (vocabulary ~30k) rather than Mixtral's 46.7B.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    params: float
    layers: int
    hidden: int
    heads: int
    seq: int
    source: str
    experts: int = 1            # MLPs per layer (1: a dense model)
    top_k: int = 1              # experts each token uses
    ffn: int | None = None      # the (experts') MLP width; None: 4·hidden
    mlp_matrices: int = 2       # hidden×ffn matrices per MLP: 2 (GELU), 3 (SwiGLU)


PRESETS = {
    "gpt3-1.3b": Preset(1.3e9, 24, 2048, 24, 2048, "GPT-3 XL (Brown et al. 2020, Table 2.1)"),
    "gpt3-175b": Preset(175e9, 96, 12288, 96, 2048, "GPT-3 (Brown et al. 2020, Table 2.1)"),
    "llama-7b": Preset(6.74e9, 32, 4096, 32, 4096, "Llama 2 7B (Touvron et al. 2023, Table 1)"),
    "llama-13b": Preset(13.0e9, 40, 5120, 40, 4096, "Llama 2 13B (Touvron et al. 2023, Table 1)"),
    "llama-70b": Preset(69.0e9, 80, 8192, 64, 4096, "Llama 2 70B (Touvron et al. 2023, Table 1; 8 kv heads, "
                                                    "modelled as 64)"),
    "mixtral-8x7b": Preset(47.5e9, 32, 4096, 32, 32768, "Mixtral 8x7B (Jiang et al. 2024, Table 1; 8 kv heads, "
                           "modelled as 32)", experts=8, top_k=2, ffn=14336, mlp_matrices=3),
}


def describe(name: str) -> str:
    """One line: the preset's numbers and where they come from."""
    p = PRESETS[name]
    moe = (f", {p.experts} experts (top-{p.top_k}, width {p.ffn}, {'SwiGLU' if p.mlp_matrices == 3 else 'GELU'})"
           if p.experts > 1 else "")
    return (f"{name}: {p.params / 1e9:g}B parameters, {p.layers} layers, hidden {p.hidden}, {p.heads} heads, "
            f"sequence {p.seq}{moe}; {p.source}")
