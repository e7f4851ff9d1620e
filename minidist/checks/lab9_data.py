"""Lab 9's case data and comparisons: the tokens, expert choices and experts every rank draws from
seeds (so one process rebuilds any rank's case), how an answer is compared with the single-process
layer, and the all-to-all bytes :mod:`minidist.cost.expert_parallel` expects.

Group rank s holds ``N + s`` tokens (uneven on purpose). A comparison is exact for integers and
booleans, within ``TOL`` relative to the values' scale for floats, and names what differs. Used by
the runners in :mod:`minidist.checks.lab9_cases`.
"""
from __future__ import annotations

from collections import Counter

import torch

import minidist
from minidist.checks.kit.launch import TOL
from minidist.checks.kit.docket import digest
from minidist.checks.kit.returned import tensor_problem
from minidist.cost import expert_parallel as cost

WORLD, HID, FFN, N = 4, 6, 8, 5          # ranks, token size, expert hidden size, tokens on group rank 0
AUX = 0.5                                # weight of the load-balancing loss in the moe_layer checks' loss
F32, F64 = torch.float32, torch.float64
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- data
def randn(shape, seed, dtype=F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64, device=CPU).to(dtype)


def make_experts(num_experts: int, hidden: int = HID, ffn: int = FFN, seed: int = 0, dtype=F32, device=None) -> list:
    """E experts, each Linear(hidden, ffn) → GELU → Linear(ffn, hidden), drawn on the CPU from ``seed``
    (the same on every rank), then moved to ``device`` (default ``minidist.device()``)."""
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(num_experts):
        layers = []
        for fan_in, fan_out in ((hidden, ffn), (ffn, hidden)):
            lin = torch.nn.Linear(fan_in, fan_out, device=CPU, dtype=F64)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(fan_out, fan_in, generator=gen, dtype=F64, device=CPU) / fan_in ** 0.5)
                lin.bias.copy_(0.1 * torch.randn(fan_out, generator=gen, dtype=F64, device=CPU))
            layers.append(lin)
        expert = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1]).to(dtype)
        experts.append(expert.to(device if device is not None else minidist.device()))
    return experts


def tokens_of(s: int) -> int:
    return N + s


def choices(case: dict, s: int, t: int) -> torch.Tensor:
    """Group rank s's expert indices (n, k): distinct experts per token; ``load`` shapes them:
    random, one_rank (only group rank 0's experts), empty_expert (each rank's last expert never chosen),
    dropped (a third of the choices −1, group rank 0's all of them: it sends nothing)."""
    num_experts, k, load = case["E"], case["k"], case.get("load", "random")
    local, n = num_experts // t, tokens_of(s)
    gen = torch.Generator().manual_seed(1000 + 31 * s + 7 * num_experts + k)
    allowed = torch.arange(num_experts, device=CPU)
    if load == "one_rank":
        allowed = allowed[:local]
    elif load == "empty_expert":
        allowed = allowed[allowed % local != local - 1]
    idx = allowed[torch.rand(n, len(allowed), generator=gen, device=CPU).argsort(-1)[:, :k]]
    if load == "dropped":
        drop = torch.rand(n, k, generator=gen, device=CPU) < 0.35
        idx = idx.masked_fill(drop | (s == 0), -1)
    return idx


# ----------------------------------------------------------------------------- comparisons
def err(what, got, want) -> str | None:
    """Why ``got`` is not ``want`` (None if it is: exact for integers and booleans, else within TOL
    relative to the values' scale)."""
    if problem := tensor_problem(what, got, want):
        return problem
    got = got.detach().to(CPU)
    if want.dtype.is_floating_point != got.dtype.is_floating_point:
        return f"{what} has dtype {got.dtype}, expected {want.dtype}"
    if not want.dtype.is_floating_point:
        if torch.equal(got.to(want.dtype), want):
            return None
        show = lambda x: x.tolist() if x.numel() <= 24 else f"a tensor of {x.numel()} other values"     # noqa: E731
        return f"{what} is {show(got)}; expected {show(want)}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}, expected {want.dtype} (the inputs' dtype)"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if not diff <= TOL * scale:
        return f"{what} differs from one process (max |error| {diff:.3g}, scale {scale:.3g})"
    return None


def unchanged(what, got: str, original: torch.Tensor) -> str | None:
    """``got``: the digest (:func:`minidist.checks.kit.docket.digest`) of the caller's tensor after the call."""
    if got != digest(original):
        return f"{what} was modified in place: the caller's tensor must stay as it was"
    return None


def traffic(tr) -> list:
    """[kind, bytes] of every traced all-to-all, sorted (the tracer counts an all-to-all's whole input)."""
    return sorted(["all-to-all" if e.op in ("all_to_all_single", "all_to_all") else e.op, e.nbytes] for e in tr.comm())


def show(c: Counter) -> str:
    return ", ".join(f"{n} x {k} of {b} B" for (k, b), n in sorted(c.items())) or "nothing"


def compare(answer: dict, phase: str, want: list) -> str | None:
    """Whether the all-to-alls the rank traced in ``phase`` carried the bytes ``want``."""
    got, want = Counter(tuple(x) for x in answer[phase]), Counter(("all-to-all", b) for b in want)
    return None if got == want else f"{phase} communicated {show(got)}; expected {show(want)}"


# ----------------------------------------------------------------------------- expected traffic
def expected(name, sent, received, num_experts, t, elem_bytes, phase) -> list:
    """Payload bytes of ``name``'s all-to-alls in ``phase``, from :func:`cost.ep_collectives` (a layer's five:
    forward counts, dispatch A rows, combine R rows; backward combine's A rows, dispatch's R rows)."""
    layer = [c.nbytes for c in cost.ep_collectives(sent, received, HID, num_experts, t, elem_bytes) if c.phase == phase]
    if name == "ep_dispatch":
        return layer[:2] if phase == "forward" else layer[1:]
    if name == "ep_combine":
        return layer[2:] if phase == "forward" else layer[:1]
    return layer


def on_rank(x):
    """A copy of ``x`` on the rank's device (never ``x`` itself: the references keep theirs untouched)."""
    return x.detach().to(minidist.device(), copy=True)
