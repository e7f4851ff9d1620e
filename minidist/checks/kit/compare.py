"""How every lab compares an answer with its reference, written once.

* :func:`tensor_error`: one tensor against the reference: not a plain tensor, another shape, another
  dtype, other values (exact for integers and booleans; within :data:`TOLERANCE` of the dtype,
  relative to the reference's scale, for floating point);
* :func:`digest`, :func:`unchanged` and :func:`untouched`: a tensor that must come back as it went
  in (an input) travels in an answer as a digest of its dtype, shape and bytes;
* :func:`seeded`: an input drawn on the CPU from its seed, the same numbers on every rank and in
  the verdict, and :func:`on_rank`, its copy on the rank's device (where the student's code meets it);
* :func:`traffic`, :func:`counted`, :func:`show` and :func:`traffic_problem`: the collectives a rank
  traced, as an answer records them, a verdict compares them with the cost model's and a failure shows them;
* :func:`first`: a verdict's one problem, the first of the several it computed.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import torch

from minidist.checks.kit.diagnosis import diagnose
from minidist.checks.kit.returned import tensor_problem
from minidist.runtime.device import device as rank_device

#: relative tolerance by dtype: |got - want| <= TOLERANCE * max(1, max |want|)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor_error(what: str, got, want: torch.Tensor, *, dtype=None, tol: float | dict | None = None,
                 slack: float = 0.0, against: str = "the reference", factors: dict | None = None) -> str | None:
    """Why ``got`` is not ``want`` (None if it is), compared on the CPU. ``dtype``: the dtype ``got``
    must have (default: ``want``'s); ``tol``: the relative tolerance (default: by dtype; a dict
    overrides some dtypes' of :data:`TOLERANCE`), plus an absolute ``slack``; ``against``: what
    ``want`` is, in the message ("one process" where the reference is the same computation
    without communication, "the fp32 run"). A float mismatch says where it is worst and, when the
    numbers show it, the likely cause (:mod:`minidist.checks.kit.diagnosis`; ``factors``: the
    case's sizes by name, {"t, the group's size": 2, ...}, that a constant factor may be)."""
    if problem := tensor_problem(what, got, want):
        return problem
    dtype = dtype or want.dtype
    if got.dtype != dtype:
        return f"{what} is {_name(got.dtype)}, expected {_name(dtype)} (make every buffer in the dtype of what it holds)"
    got, want = got.detach().cpu(), want.detach().cpu()
    if not dtype.is_floating_point:
        if torch.equal(got, want.to(dtype)):
            return None
        show = lambda x: x.tolist() if x.numel() <= 24 else f"a tensor of {x.numel()} other values"     # noqa: E731
        return f"{what} is {show(got)}; expected {show(want)}"
    got, want = got.double(), want.double()
    if tol is None or isinstance(tol, dict):
        tol = {**TOLERANCE, **(tol or {})}.get(dtype, 1e-5)
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if diff <= tol * scale + slack:             # NaN fails too
        return None
    allowed = f"tolerance {tol:.3g}" + (f" relative + {slack:.3g}" if slack else "")
    return (f"{what} differs from {against} (max |error| {diff:.3g}, scale {scale:.3g}, {allowed})"
            + diagnose(got, want, tol * scale + slack, factors, what))


# ----------------------------------------------------------------------------- inputs that must come back unchanged
def digest(x: torch.Tensor) -> str:
    """A tensor as an answer records it when it must come back unchanged: its dtype, shape and bytes, hashed."""
    flat = x.detach().to("cpu").contiguous()
    body = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.sha256(f"{flat.dtype} {tuple(flat.shape)} ".encode() + body).hexdigest()


def unchanged(what: str, got: str, original: torch.Tensor, when: str = "the call") -> str | None:
    """``got``: the digest of the caller's tensor ``what`` after ``when``; None if it is ``original``'s."""
    if got == digest(original):
        return None
    return (f"the caller's {what} changed during {when}: a graded function leaves its inputs as it found them "
            f"(work on a copy, or use out-of-place operations)")


def untouched(digests: dict, originals: dict, when: str = "the call") -> str | None:
    """The first of the caller's tensors ({name: as it went in}) whose digest after ``when`` (``digests``:
    {name: digest}) is not its own; None when every one came back unchanged."""
    for what, original in originals.items():
        if original is not None and (problem := unchanged(what, digests.get(what), original, when)):
            return problem
    return None


# ----------------------------------------------------------------------------- inputs
def seeded(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Normal numbers drawn on the CPU from ``seed`` (in float64, then cast): the same on every rank,
    every device and in the verdict, whatever the dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(dtype)


def on_rank(x: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """A copy of the CPU tensor ``x`` on this rank's device (``minidist.device()``), a leaf that
    requires grad when asked: the student's code never holds the check's own tensor."""
    out = x.detach().to(rank_device(), copy=True)
    return out.requires_grad_() if grad else out


# ----------------------------------------------------------------------------- traffic
#: torch.distributed's names for one kind of collective, as a failure names it
FAMILY = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
          "all_gather": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
          "reduce_scatter_single": "reduce-scatter", "reduce_scatter": "reduce-scatter",
          "all_to_all_single": "all-to-all", "all_to_all": "all-to-all"}


def traffic(tr) -> list:
    """[kind, payload bytes] of every collective a trace recorded, sorted: an answer's record of its traffic."""
    return sorted([FAMILY.get(e.op, e.op), e.nbytes] for e in tr.comm())


def counted(record: list) -> Counter:
    return Counter(tuple(x) for x in record)


def show(c: Counter) -> str:
    """'2 x all-reduce of 96 B, 1 x all-gather of 48 B' (or 'nothing')."""
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def traffic_problem(phase: str, got, want, accept=None) -> str | None:
    """"forward communicated 1 x all-reduce of 96 B; expected ..." unless ``got`` (a :func:`traffic` record
    or a Counter of (kind, bytes)) equals ``want``, or ``accept(got, want)`` (Counters) allows the difference."""
    got, want = (x if isinstance(x, Counter) else counted(x) for x in (got, want))
    if got == want or (accept is not None and accept(got, want)):
        return None
    return f"{phase} communicated {show(got)}; expected {show(want)}"


def first(problems) -> str | None:
    """The first problem of several (None and "" are none): what a verdict returns."""
    return next((p for p in problems if p), None)
