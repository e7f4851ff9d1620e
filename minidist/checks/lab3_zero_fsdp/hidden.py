"""Lab 3's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`."""
import torch

#: reduce_scatter_gradients: units after the visible ones (shapes, index of the parameter without a
#: gradient, dtype), on these world sizes
UNITS = [([(1,)], None, torch.float32), ([(6, 7), (6,), (9,)], 0, torch.float32),
         ([(5, 3), (4,)], None, torch.float64)]
UNIT_WORLD_SIZES = (2, 3, 4)
UNITS_SHOWN = "fp32/fp64"

#: Zero(stage=s): these model variants (instead of the visible ones), on these world sizes
ZERO_MODELS = ["frozen", "unused"]
ZERO_WORLD_SIZES = (3, 4)
