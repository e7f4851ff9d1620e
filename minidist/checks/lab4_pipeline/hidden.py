"""Lab 4's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases` (instead of the visible ones)."""
import torch

from minidist.checks.lab4_pipeline.cases import Case

#: the schedule builders: (p, m)
SCHEDULES = [(1, 1), (1, 3), (2, 7), (3, 1), (3, 2), (3, 5), (4, 3), (5, 3), (5, 8), (6, 12)]

#: the executor: world size -> its runs
EXECUTOR = {3: [Case("gpipe", 1, 6), Case("1f1b", 5, 10), Case("gpipe", 6, 12),
                Case("1f1b", 3, 9, torch.float64), Case("1f1b", 4, 8, p=1)],
            4: [Case("1f1b", 2, 8), Case("1f1b", 8, 16)]}
