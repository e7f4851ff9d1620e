"""Lab 5's case data and comparisons: the groups, inputs drawn on the CPU from seeds (so one process
rebuilds any rank's case), how a result is compared with the single-process module (within
``TOL``, ``TOLS`` for bf16; in the inputs' dtype), and the collectives the cost model expects
(:mod:`minidist.cost.tensor_parallel`), kind and payload bytes in any order; and ``_call``, how an
answer runs the student's function (forward, then backward, each traced). Used by the runners in
:mod:`minidist.checks.lab5_cases` and :mod:`minidist.checks.lab5_modules`, and the measurements in
:mod:`minidist.checks.lab5_tensor_parallel`.
"""
from __future__ import annotations

from collections import Counter

import torch

from minidist.checks.kit.launch import TOL
from minidist.checks.kit.docket import digest
from minidist.checks.kit.groups import consecutive_groups, wrong_group_hint
from minidist.checks.kit.returned import tensor_problem
from minidist.models import GPTConfig
from minidist.runtime.device import device as rank_device
from minidist.tensor_parallel.comm import shard_range
from minidist.trace import trace

WORLD, B, S = 4, 2, 12                 # S divisible by 1, 2, 3 and 4 (sequence shards)
CFG = GPTConfig(vocab=48, d_model=24, n_heads=12, d_ff=48, n_layers=1, seq_len=S)
SEQ = 1                                # activations are (batch, seq, hidden)
TOLS = {torch.bfloat16: 2e-2}          # relative; TOL for fp32 and fp64 (sums of t bf16 numbers round)

# ----------------------------------------------------------------------------- groups, data
def _groups(ts) -> dict:
    """{t: (group, rank in it, its size)}: blocks of t consecutive ranks of the 4."""
    return consecutive_groups(ts, WORLD)


def _randn(shape, seed, dtype=torch.float32):
    """Drawn on the CPU from its seed: the same numbers on every rank and device."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype, device="cpu")


def _dev(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """A copy of CPU tensor ``t`` on this rank's device (a leaf that requires grad when asked)."""
    out = t.detach().to(rank_device(), copy=True)
    return out.requires_grad_() if grad else out


def _part(x, dim, r, t):
    return x.tensor_split(t, dim=dim)[r]


def _masked(full, dim, r, t):
    """The gradient rank r's slice of a replicated parameter gets: its chunk, zeros elsewhere."""
    out = torch.zeros_like(full)
    a, b = shard_range(full.shape[dim], r, t)
    out.narrow(dim, a, b - a).copy_(full.narrow(dim, a, b - a))
    return out


def _err(what, got, want):
    if problem := tensor_problem(what, got, want):
        return problem
    if got.dtype != want.dtype:
        return (f"{what} is {str(got.dtype).replace('torch.', '')}, expected {str(want.dtype).replace('torch.', '')} "
                f"(the inputs' dtype: make every buffer with the dtype of the tensor it holds)")
    tol = TOLS.get(want.dtype, TOL)
    got, want = got.detach().cpu().double(), want.double()
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= tol * max(1.0, want.abs().max().item() if want.numel() else 1.0):
        ratio = ""
        if want.norm() > 0:
            ratio = f", |got|/|expected| = {(got.norm() / want.norm()).item():.3f}"
        return f"{what} differs from one process (max |error| {diff:.3g}{ratio})"
    return None


# ----------------------------------------------------------------------------- traffic
FAMILY = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
          "all_gather": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
          "reduce_scatter_single": "reduce-scatter", "reduce_scatter": "reduce-scatter"}


def _traffic(tr) -> list:
    """[kind, payload bytes] of every traced op, sorted (the tracer counts a list all_gather's input, as
    the tensor form's): an answer's record of its traffic."""
    return sorted([FAMILY.get(e.op, e.op), e.nbytes] for e in tr.comm())


def _call(fn, args, upstream, held: dict, kwargs=None) -> dict:
    """Forward, then backward of sum(out * upstream) (or out.backward()), each under the tracer: the
    output, each phase's traffic, and digests of the caller's tensors ``held`` after each phase."""
    with trace() as tf:
        out = fn(*args, **(kwargs or {}))
    after_forward = {n: digest(x) for n, x in held.items() if x is not None}
    with trace() as tb:
        (out * upstream).sum().backward() if upstream is not None else out.backward()
    return {"out": out, "forward": _traffic(tf), "backward": _traffic(tb),
            "held": [after_forward, {n: digest(x) for n, x in held.items() if x is not None}]}


def counted(traffic: list) -> Counter:
    return Counter(tuple(x) for x in traffic)


def _expected(colls, phase) -> Counter:
    return Counter((FAMILY[c.op], c.nbytes) for c in colls if c.phase == phase)


def _show(c: Counter) -> str:
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def _compare_traffic(got: dict, want: dict, extra=None) -> str | None:
    """``got``/``want``: {phase: Counter}. ``extra(phase, leftover) -> bool`` may accept what is left over."""
    got = {phase: counted(g) if isinstance(g, list) else g for phase, g in got.items()}
    for phase in ("forward", "backward"):
        g, w = got[phase], want.get(phase, Counter())
        if g == w or (extra is not None and not (w - g) and extra(phase, g - w)):
            continue
        return f"{phase} communicated {_show(g)}; expected {_show(w)}"
    return None


def unchanged(digests: dict, originals: dict, when: str) -> str | None:
    """``digests``: {name: digest} of the caller's tensors after ``when``; ``originals``: {name: tensor} as
    they went in (:func:`minidist.checks.kit.docket.digest`)."""
    for name, was in originals.items():
        if digests.get(name) != digest(was):
            return (f"the caller's {name} changed during {when}: a graded function leaves its inputs as it "
                    f"found them (reduce into a tensor you own, e.g. a clone, not into the caller's)")
    return None


def _untouched(answer: dict, originals: dict) -> str | None:
    return (unchanged(answer["held"][0], originals, "the forward")
            or unchanged(answer["held"][1], originals, "the backward"))


def _with_traffic(errs: list, t: int, calls: list, want: dict, extra=None) -> list:
    """The problems, then (when there are none, for t > 1) what each call's traffic got wrong."""
    if any(errs) or t == 1:
        return errs
    for i, call in enumerate(calls):
        problem = _compare_traffic({p: call[p] for p in ("forward", "backward")}, want, extra)
        if problem:
            return [problem + (" (second call on the same module)" if i else "")]
    return errs


def _hinted(problem, got, want, world, t):
    """``problem`` with the wrong-group diagnosis added when ``got`` is the sum over the world's ranks."""
    hint = problem and wrong_group_hint(got, want, world, t, WORLD)
    return f"{problem}.{hint}" if hint else problem


def _world(shape, base, dtype, t):
    """What a sum over every rank of the world gives (a collective without group=): world rank w
    is rank w % t of its group, so it drew its data from seed ``base + w % t``."""
    return sum(_randn(shape, base + w % t, dtype) for w in range(WORLD))
