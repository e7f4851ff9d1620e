"""Lab 5's hidden cases: the grader's, left out of the student wheel (``autograder/handout/student_dist.py``).
``cases.py`` reads them through :func:`minidist.checks.kit.withheld.hidden_cases`: the cases the lab
states (no bias, 2-D and odd shapes, fp64 and bf16, an uneven vocabulary, a custom ignore_index,
logits that overflow exp without the max, GQA, heads that do not split), after the visible ones."""
import torch

from minidist.checks.lab5_tensor_parallel.cases import B, S

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

#: the group sizes every function runs on
TS = (1, 2, 3, 4)

#: copy_to_tp / reduce_from_tp: (shape, dtype) after the visible activation
F_G_SHAPES = [((5,), F64), ((3, 7), F32), ((4, 6), BF16)]

#: column/row_parallel_linear: changes to the visible layer
LINEAR = [{"bias": False, "lead": (10,)}, {"d_in": 48, "d_out": 12, "dtype": F64}]

#: vocab_parallel_cross_entropy: changes to the visible case (a scale of 400 overflows exp without the max)
CROSS_ENTROPY = [{"vocab": 50, "uneven": True}, {"ignore_index": 7, "lead": (B, S)}, {"scale": 400.0}, {"dtype": F64}]

#: the other functions: cases after one per t
MORE = {
    "tp_mlp": [dict(t=4, cfg=dict(d_ff=96)), dict(t=3, dtype=F64)],
    # grouped-query attention (t divides n_kv_heads), and heads that do not split
    "tp_attention": [dict(t=2, cfg=dict(n_kv_heads=4)), dict(t=4, cfg=dict(n_kv_heads=4)),
                     dict(t=3, cfg=dict(n_kv_heads=3)), dict(t=3, dtype=F64),
                     dict(t=3, cfg=dict(n_heads=4, n_kv_heads=4), raises=True),       # neither splits over 3
                     dict(t=3, cfg=dict(n_kv_heads=4), raises=True)],                 # 12 query heads do, 4 kv do not
    "sp_gather": [dict(t=t, dtype=d) for t in (2, 3) for d in (F64, BF16)],
    "sp_reduce_scatter": [dict(t=t, dtype=d) for t in (2, 3) for d in (F64, BF16)],
    "sp_mlp_block": [dict(t=3, dtype=F64)],
}
