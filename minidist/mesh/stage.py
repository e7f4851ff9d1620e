"""A pipeline stage whose layers are tensor-parallel: the unit a 3D mesh rank holds.

Narayanan et al. 2021 (Megatron-LM, PTD-P), Sec. 3: the model's L layers are cut into
p contiguous stages of L/p layers (stage 0 also holds the embeddings, the last stage the
final LayerNorm, the LM head and the loss), and each stage is split over its t
tensor-parallel ranks exactly as :class:`minidist.tensor_parallel.ParallelGPT` splits the
whole model. Between stages flows the (b, s, h) activation every TP rank of a stage
holds (with sequence parallelism, its (b, s/t, h) shard): TP rank i of stage k talks to
TP rank i of stage k ± 1 only.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from minidist.tensor_parallel import ParallelGPT, sync_sequence_parallel_grads


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The layers of ``stage``: L/p consecutive ones (equal stages: 1F1B's balance needs them)."""
    if n_layers % pp:
        raise ValueError(f"{n_layers} layers do not split into pp={pp} equal stages")
    per = n_layers // pp
    return range(stage * per, (stage + 1) * per)


class GPTStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a :class:`minidist.models.TinyGPT`, tensor-parallel
    over ``group``. ``forward``: ids (stage 0) or the previous stage's activation -> the next
    stage's activation, or this rank's logits (b, s, V/t) on the last stage."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int, group=None, *,
                 sequence_parallel: bool = False, seed: int = 0):
        super().__init__()
        layers = stage_layers(model.cfg.n_layers, num_stages, stage)
        self.stage, self.num_stages, self.group = stage, num_stages, group
        self.first, self.last = stage == 0, stage == num_stages - 1
        # ParallelGPT reads only these attributes: hand it this stage's layers, cut them once
        part = SimpleNamespace(cfg=model.cfg, tok_emb=model.tok_emb, pos_emb=model.pos_emb,
                               blocks=[model.blocks[i] for i in layers], ln_f=model.ln_f, lm_head=model.lm_head)
        gpt = ParallelGPT(part, group, sequence_parallel=sequence_parallel, seed=seed)
        if not self.first:              # a stage holds only its own ends: the others' weights are not its memory
            gpt.tok_emb = gpt.pos_emb = None
        if not self.last:
            gpt.ln_f = gpt.lm_head = None
        self.gpt = gpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.gpt.embed(x)
        for block in self.gpt.blocks:
            x = block(x)
        return self.gpt.head(x) if self.last else x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel mean cross entropy of one micro-batch (last stage)."""
        return self.gpt.loss(logits, targets)

    def sync_grads(self) -> int:
        """Under SP, after the last micro-batch's backward: sum the partial gradients over TP."""
        return sync_sequence_parallel_grads(self, self.group) if self.gpt.sequence_parallel else 0

    def activation_shape(self, micro_batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the tensor sent to the next stage (and of its gradient coming back)."""
        t = self.gpt.t
        return (micro_batch, seq // t if self.gpt.sequence_parallel else seq, self.gpt.cfg.d_model)
