"""Lab 11's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`: a group of one rank, an
odd ring (t = 3), fp64, a single unit (nothing to prefetch), one row per shard, and timelines with waits
nested in one another, touching end to end, and of zero length."""
import torch

from minidist.checks.lab11_overlap.cases import comm, region

F64 = torch.float64

MORE = {
    "prefetch_forward": [dict(t=3, units=4, d=12, rows=2), dict(t=1, units=2, d=12, rows=3),
                         dict(t=4, units=1, d=8, rows=3), dict(t=2, units=2, d=8, rows=4, dtype=F64)],
    "all_gather_matmul": [dict(t=3, n=2, k=5, m=7), dict(t=1, n=3, k=4, m=4), dict(t=4, n=1, k=6, m=3),
                          dict(t=2, n=4, k=3, m=5, dtype=F64)],
    "matmul_reduce_scatter": [dict(t=3, n=2, k=5, m=7), dict(t=1, n=3, k=4, m=4), dict(t=4, n=1, k=6, m=3),
                              dict(t=2, n=4, k=3, m=5, dtype=F64)],
}

TIMELINES = [
    dict(rank=3, events=[]),                                                            # nothing: 0 s
    dict(rank=2, events=[comm("all_gather_into_tensor", 2, 0.0, 1.0, issued=0.0, waited=1.0),   # zero-length waits
                         region("compute:layer", 2, 0.0, 1.0)]),
    dict(rank=1, events=[comm("recv", 1, 1.0, 2.0), comm("recv", 1, 2.0, 3.0),           # end to end
                         comm("isend", 1, 0.5, 6.0, issued=0.75, waited=5.0), comm("send", 1, 5.5, 5.75),  # nested
                         region("compute:matmul", 1, 3.0, 5.0), comm("barrier", 0, 0.0, 9.0)]),
    dict(rank=0, events=[comm("all_reduce", 0, 0.0, 8.0, issued=0.5, waited=7.0), comm("broadcast", 0, 0.25, 0.75),
                         comm("irecv", 0, 1.0, 7.5, issued=1.0, waited=7.25), region("span:step", 0, 0.0, 8.0)]),
]
