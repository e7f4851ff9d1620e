"""Lab 2's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases` and adds them after the
visible ones."""
import torch

from minidist.checks.lab2_data_parallel.cases import SHAPES
from minidist.models import TINY_MLP_VARIANTS

#: the world sizes of the launched checks (average_gradients, BucketedDDP)
WORLD_SIZES = (3, 4)

#: split_batch: (batch, world size) that split; (batch, world size, features) that must raise, with
#: feature counts that make x.numel() and y.numel() divisible by world_size when the batch is not
#: (a check on the wrong quantity passes the visible case only)
SPLIT = [(24, 4), (5, 5), (7, 1), (30, 6)]
SPLIT_BAD = [(6, 4, 2), (7, 2, 2), (3, 4, 4), (9, 6, 2)]

#: average_gradients: every model variant
AVERAGE_MODELS = list(TINY_MLP_VARIANTS)

#: make_buckets: (shapes, dtype of every parameter, cap in bytes)
BUCKETS = [(SHAPES, torch.float32, 4), (SHAPES, torch.float32, 10 ** 6), (SHAPES, torch.float32, 676),
           (SHAPES, torch.float32, 728), ([(3,)], torch.float32, 12), ([(100,), (1,), (1,)], torch.float32, 8),
           (SHAPES, torch.float64, 700), (SHAPES, torch.float64, 2704),
           (SHAPES, torch.bfloat16, 400), (SHAPES, torch.bfloat16, 338)]
BUCKETS_SHOWN = "fp32/fp64/bf16"

#: BucketedDDP: (a model variant's name or its keywords, cap in bytes)
BUCKETED = [("tied", 300), ({"tied": True, "frozen": True, "unused": True}, 4), ("plain", 1 << 20)]
