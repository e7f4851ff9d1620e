"""The toy lab's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
Each exercise's module reads its own through :func:`minidist.checks.kit.withheld.hidden_cases`."""
import torch

ADD = [dict(args=(10, -3), want=7), dict(args=(0.5, 0.25), want=0.75)]          # negative numbers and floats
ALLSUM_LENGTHS = (5, 1)
ALLSUM_DTYPES = (torch.float64,)
ALLSUM_SHOWN = "lengths 5 and 1 in fp64"
