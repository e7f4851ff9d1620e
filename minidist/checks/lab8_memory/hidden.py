"""Lab 8's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`."""
import torch

F16, F32 = torch.float16, torch.float32

#: the group sizes the launched checks run on
TS = (1, 2, 3, 4)

#: DynamicLossScaler: constructor keywords whose update history is checked (after the visible one), and
#: keywords that must raise
SCALER_SETTINGS = [dict(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=1),
                   dict(init_scale=1.0, growth_interval=2)]
SCALER_BAD = [dict(init_scale=0.0), dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(growth_interval=0)]

#: DynamicLossScaler.unscale_: cases after the visible ones
UNSCALE = ([dict(t=t, dtype=F32, bad_rank=t - 1, bad=float("nan"), no_grad=1) for t in TS]
           + [dict(t=t, dtype=F16, bad_rank=1, bad=float("-inf")) for t in (2, 3)]
           + [dict(t=t, dtype=F32, scale=1000.0) for t in (1, 4)])

#: both steps (instead of the visible cases)
STEPS = ([dict(t=t, dtype="fp16", scaler=True, opt="adam", steps=3, overflow=(1, t - 1), vs_fp32=True) for t in TS]
         + [dict(t=t, dtype="bf16", scaler=False, opt="sgd", steps=3, vs_fp32=True) for t in (1, 3)]
         + [dict(t=t, raises=True) for t in (2, 3)])

#: recompute_blocks: cases after the visible ones
RECOMPUTE = ([dict(policy=p, dropout=0.0) for p in ("none", "full", "selective")]
             + [dict(policy=p, dropout=0.1, n_layers=3) for p in ("full", "selective")]
             + [dict(policy="checkpoint", dropout=0.0, raises=True)])

#: the ✓ line of each hidden check
COVERED = {
    "DynamicLossScaler": "t=1..4, NaN/-inf on one rank, fp16 grads, a missing grad, scale 1000, bad arguments",
    "mixed_precision_step": "t=1..4: overflow on one rank skipped everywhere, 3 steps, vs fp32 training, ValueError",
    "zero1_mixed_precision_step": ("t=1..4: overflow on one rank's shard skipped everywhere, vs fp32 training, "
                                   "ValueError"),
    "recompute_blocks": "none, no dropout, 3 layers, bad policy (ValueError)",
}
