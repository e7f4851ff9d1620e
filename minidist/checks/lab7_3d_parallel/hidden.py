"""Lab 7's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`."""
import dataclasses

from minidist.checks.lab7_3d_parallel.cases import CFG, MemoryConfig
from minidist.harness.parallel3d import Layout
from minidist.models import GPTConfig

_NO_BIAS = dataclasses.replace(CFG, bias=False)
_GQA = GPTConfig(vocab=64, d_model=32, n_heads=8, n_kv_heads=2, n_layers=6, seq_len=16, d_ff=96)
_BIG = GPTConfig(vocab=32000, d_model=4096, n_heads=32, n_layers=32, seq_len=4096, d_ff=16384)

#: mesh_groups: (world, d, p, t) meshes after the visible ones, then sizes that must raise
MESH = [(16, 2, 2, 4), (24, 2, 3, 4), (12, 3, 2, 2), (6, 1, 3, 2), (4, 4, 1, 1), (4, 1, 1, 4),
        (1, 1, 1, 1), (64, 2, 4, 8), (30, 5, 3, 2)]
MESH_BAD = [(8, 2, 3, 2), (16, 2, 2, 2),
            (8, -2, -2, 2), (8, 2, -1, -4), (-8, -2, 2, 2), (0, 0, 1, 1),      # products fine, sizes not positive
            (6, 1, 1.5, 4), (5, 2.5, 2, 1), (8, 2, 2, 2.0 + 0.5)]               # ... or not integers
MESH_BAD_SHOWN = "products, negative, zero, non-integer"

#: predict_memory: ranks after the visible ones
MEMORY = ([MemoryConfig(CFG, 2, 4, 1, s, 8, 4) for s in range(4)]          # 1F1B: p - stage in flight
          + [MemoryConfig(CFG, 1, 4, 2, s, 8, 2) for s in (0, 3)]          # ... at most m
          + [MemoryConfig(CFG, 4, 1, 2, 0, 8, 2, "gpipe", "sgd")]
          + [MemoryConfig(CFG, 4, 2, 1, s, 16, 2, zero_stage=z) for s in (0, 1) for z in (1, 2, 3)]
          + [MemoryConfig(_NO_BIAS, 2, 2, 2, 1, 8, 2), MemoryConfig(_GQA, 2, 3, 2, 1, 12, 2, "gpipe"),
             MemoryConfig(_BIG, 2, 4, 4, 0, 512, 128, zero_stage=1, elem_bytes=2),
             MemoryConfig(_BIG, 2, 4, 4, 3, 512, 128, zero_stage=1, elem_bytes=2)])
MEMORY_SHOWN = "1F1B/GPipe, SGD, ZeRO 1-3, no bias, GQA, 7B"

#: stage_parameters: (cfg, pp, tp) after the visible ones
STAGES = [(CFG, 4, 1), (_NO_BIAS, 2, 2), (_GQA, 3, 2), (_GQA, 1, 1), (_BIG, 4, 4), (_BIG, 8, 8)]
STAGES_SHOWN = "no bias, GQA, 7B"

#: train_step_3d: the layouts it trains (instead of the visible ones)
STEP = [Layout(2, 4, 1, "1f1b", 4), Layout(4, 1, 2, "gpipe", 2)]
