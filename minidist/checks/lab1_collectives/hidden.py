"""Lab 1's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`.

World sizes 1-5 (1, 2, 4 where the function needs a power of two); lengths divisible by N, not,
and below N; fp32 and fp64.
"""
import torch

WORLD_SIZES = (1, 2, 3, 4, 5)
WORLD_SIZES_POW2 = (1, 2, 4)
LENGTHS = (1, lambda n: n - 1, lambda n: 2 * n + 1, lambda n: 4 * n, 37)
LENGTHS_SHOWN = "1, N-1, 2N+1, 4N, 37"
DTYPES = (torch.float32, torch.float64)
REJECTED = (6,)           # recursive halving: a world size that is not a power of two, refused
