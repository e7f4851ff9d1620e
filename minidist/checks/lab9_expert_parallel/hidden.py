"""Lab 9's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases` and adds them after the
visible ones: every token sent to one rank, a starved expert, every choice of a rank dropped, bad input."""
import torch

F32, F64 = torch.float32, torch.float64

#: top_k_router
ROUTER = [dict(n=12, E=8, k=2, capacity=1.25, dtype=F64, skew=3.0),
          dict(n=9, E=3, k=1, capacity=0.5, dtype=F32),
          dict(n=16, E=8, k=2, capacity=1.0, dtype=F32, skew=2.0), dict(n=7, E=5, k=5, capacity=None, dtype=F64),
          dict(n=10, E=4, k=2, capacity=2.0, dtype=F32, skew=4.0), dict(n=11, E=4, k=2, capacity=0.7, dtype=F64),
          dict(n=6, E=4, k=5, capacity=None, dtype=F32, raises="k > E"),
          dict(n=6, E=4, k=0, capacity=None, dtype=F32, raises="k = 0"),
          dict(n=6, E=4, k=1, capacity=0.0, dtype=F32, raises="capacity_factor = 0"),
          dict(n=6, E=4, k=1, capacity=-1.0, dtype=F32, raises="capacity_factor < 0"),
          dict(n=6, E=4, k=1, capacity=None, dtype=F32, raises="logits of 3 dimensions")]

#: load_balancing_loss
LOSS = [dict(n=12, E=8, k=1, dtype=F64), dict(n=10, E=4, k=2, dtype=F32, starve=True),
        dict(n=9, E=6, k=3, dtype=F64), dict(n=6, E=4, k=1, dtype=F32, raises=True)]

#: ep_dispatch and ep_combine; then dispatch's bad input
EXCHANGE = [dict(t=1, E=4, k=2, dtype=F64), dict(t=2, E=2, k=1, dtype=F64),
            dict(t=4, E=8, k=1, dtype=F32, load="one_rank"), dict(t=2, E=8, k=2, dtype=F64, load="one_rank"),
            dict(t=4, E=8, k=2, dtype=F32, load="empty_expert"),
            dict(t=2, E=6, k=2, dtype=F32, load="dropped"),
            dict(t=4, E=4, k=1, dtype=F64, load="dropped")]
DISPATCH_RAISES = [dict(t=4, E=6, k=1, dtype=F32, raises="split"), dict(t=2, E=4, k=2, dtype=F32, raises="rows")]

#: moe_layer
MOE = [dict(t=1, E=2, k=1, dtype=F64), dict(t=2, E=4, k=1, dtype=F64, skew=True),
       dict(t=4, E=8, k=2, dtype=F32, capacity=1.0, skew=True),
       dict(t=2, E=6, k=2, dtype=F64, capacity=0.5), dict(t=4, E=4, k=1, dtype=F32, capacity=1.5),
       dict(t=4, E=6, k=1, dtype=F32, raises="split"), dict(t=2, E=4, k=2, dtype=F32, raises="k"),
       dict(t=2, E=4, k=2, dtype=F32, capacity=0.0, raises="capacity"),
       dict(t=4, E=4, k=1, dtype=F32, raises="shape")]

#: the end of the launched checks' ✓ lines
COVERED = {"moe_layer": "k = 1, 2, fp32/fp64, capacity and dropless, a starved expert, bad input",
           "ep_combine": "k = 1, 2, fp32/fp64, one busy rank, a starved expert, a rank that sends nothing",
           "ep_dispatch": "k = 1, 2, fp32/fp64, one busy rank, a starved expert, a rank that sends nothing, bad input"}
