"""Lab 10's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases` and adds them after the
visible ones (the state shapes and ``lay`` are ``cases.py``'s)."""
import torch

from minidist.checks.lab10_checkpointing.cases import UNEVEN, lay

SAVE = [dict(seed=4, shapes=UNEVEN, layout=lay("rows", 4)),          # 7 and 5 rows over 4 ranks
        dict(seed=5, shapes=UNEVEN, layout=lay("cols", 3)),
        dict(seed=6, shapes=UNEVEN, layout=lay("rows", 4), dtype=torch.float64, crash_at=3),
        dict(seed=7, shapes={"w": (3, 2)}, layout=lay("rows", 4)),       # rank 3 holds nothing
        dict(seed=19, shapes=UNEVEN, layout=lay("rows", 3), fail=("file", 1)),
        dict(seed=20, shapes=UNEVEN, layout=lay("replicated", 2), dtype=torch.bfloat16, fail="metadata")]

LOAD = [dict(seed=14, shapes=UNEVEN, saved=lay("replicated", 2), load=lay("cols", 3)),
        dict(seed=15, shapes=UNEVEN, saved=lay("cols", 3), load=lay("replicated", 2)),
        dict(seed=16, shapes=UNEVEN, saved=lay("rows", 4), load=lay("cols", 4), dtype=torch.float64),
        dict(seed=17, shapes=UNEVEN, saved=lay("cols", 2), load=lay("rows", 3), torn=True)]

#: directories under a root, each (name, what happened to it), and the one a restart must use
LATEST = [dict(dirs=[("step_1", "good"), ("step_2", "corrupted")], want="step_1"),
          dict(dirs=[("step_12", "good"), ("step_3", "good"), ("step_11", "missing")], want="step_12"),
          dict(dirs=[("step_7", "torn"), ("step_8", "garbled")], want=None),
          dict(dirs=[], want=None),
          dict(dirs=[("step_98", "good"), ("step_99", "truncated"), ("step_100", "torn"),
                     ("step_101.tmp", "good")], want="step_98")]

#: checkpoint_interval (C, per-GPU MTBF, GPUs): one GPU, a save longer than 2M (Daly's optimum is M), a tiny save
INTERVAL = [dict(args=(20.0, 50000.0, 1)), dict(args=(5000.0, 8.0e6, 4096)), dict(args=(0.5, 1.0e7, 512))]

#: goodput (τ, C, M[, R[, B]]): an interval so long that nothing is kept (0), a restart, an asynchronous save
#: that stalls for nothing
GOODPUT = [dict(args=(50000.0, 60.0, 11160.0)), dict(args=(1200.0, 30.0, 3600.0, 120.0)),
           dict(args=(300.0, 300.0, 7200.0, 0.0, 0.0))]

#: AsyncSaver: a failure surfaced by the next save, and a bf16 state saved twice
ASYNC = [dict(scenario="fails_then_save", seed=33), dict(scenario="two", seed=34, dtype=torch.bfloat16)]

#: train_resumable: no scaler, killed right after a save then mid-save; killed in the very first save (nothing to
#: resume from), then mid-step, to resume from step 5, the end of the first epoch (5 batches of 4 in 20 examples)
RESTART = [dict(steps=7, every=2, scaler=False, kills=(("step", 0, 3), ("save", 1, 4))),
           dict(steps=9, every=5, scaler=True, kills=(("save", 1, 5), ("step", 1, 8)))]
