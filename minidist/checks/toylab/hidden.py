"""The toy lab's hidden cases: the grader's, left out of the student wheel (``autograder/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`."""
import torch

ADD = [(10, -3, 7), (0.5, 0.25, 0.75)]          # negative numbers and floats
ALLSUM_LENGTHS = (5, 1)
ALLSUM_DTYPES = (torch.float64,)
ALLSUM_SHOWN = "lengths 5 and 1 in fp64"
