"""Checks of a collective built from send/recv (lab 1's, the toy lab's, the library's own tests): one
launch per world size runs every case (length x dtype [x root]) on deterministic random inputs inside
``trace()`` and ``guard()`` (only send/recv/isend/irecv allowed, so calling ``dist.all_reduce`` or
minidist's own implementation is caught); the verdict compares every rank's result with torch on the
same inputs, then the traced communication pattern (:mod:`minidist.checks.kit.collective_patterns`).
Inputs are made on the CPU (reproducible on every machine) and moved to the rank's device
(``minidist.device()``: its GPU under NCCL); results come back to the CPU, where they are compared
with torch's sum of the same CPU inputs.

A collective is graded by a ``"launch"`` :class:`~minidist.checks.kit.check.Check` (:func:`check`) whose
cases are :class:`Launch`\\ es (:func:`collective_cases`)::

    check(CHECKS, "ring_all_reduce_correct", lambda hidden: collective_cases("all_reduce", (2, 3, 4), (8, 10),
          (torch.float32,), name="ring_all_reduce", pattern="ring"), function="ring_all_reduce")

Failures name the function, the input (world size, length, dtype), the rank, what was expected and
what was seen. A function that deadlocks fails after the Check's timeout with the launcher's
``LaunchError`` (which rank is blocked in which operation, on which line), prefixed with the case that
was running.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from minidist.checks.kit.collective_patterns import PATTERNS
from minidist.checks.kit.diagnosis import sum_of_which_inputs
from minidist.checks.kit.run import mark
from minidist.runtime import device
from minidist.trace import Trace, guard, merge, trace

P2P_ONLY = frozenset({"send", "recv", "isend", "irecv"})
_WHY = "graded collectives must be built from dist.send/recv/isend/irecv only"
FORBIDDEN_HINT = ("Use only dist.send/recv/isend/irecv (and your own helpers); torch.distributed "
                   "collectives and minidist's implementations are off limits here.")


@dataclass(frozen=True)
class Case:
    world_size: int
    length: int
    dtype: torch.dtype
    root: int | None = None          # src of broadcast/scatter, dst of reduce/gather

    def __str__(self):
        root = "" if self.root is None else f", root={self.root}"
        return f"world_size={self.world_size}, length={self.length}, {str(self.dtype).replace('torch.', '')}{root}"


def make_input(case: Case, rank: int, seed: int = 0) -> torch.Tensor:
    """The tensor rank ``rank`` gets for ``case``, on the CPU: random, different on every rank,
    reproducible. A rank moves it to its device (``minidist.device()``); the reference uses it as is."""
    g = torch.Generator(device="cpu").manual_seed(hash((seed, case.world_size, case.length, rank)) % (2 ** 62))
    return torch.randn(case.length, generator=g, dtype=torch.float64, device="cpu").to(case.dtype)


# ----------------------------------------------------------------------------- references
def _sum(xs):
    return torch.stack(xs).sum(0)


KINDS = {   # kind -> (how to call fn, reference result on rank r or None if unchecked, exact?)
    "all_reduce": (lambda fn, x, c: fn(x), lambda xs, r, c: _sum(xs), False),
    "reduce_scatter": (lambda fn, x, c: fn(x), lambda xs, r, c: _sum(xs).tensor_split(c.world_size)[r], False),
    "broadcast": (lambda fn, x, c: fn(x, c.root), lambda xs, r, c: xs[c.root], True),
    "reduce": (lambda fn, x, c: fn(x, c.root), lambda xs, r, c: _sum(xs) if r == c.root else None, False),
    "scatter": (lambda fn, x, c: fn(x, c.root), lambda xs, r, c: xs[c.root].tensor_split(c.world_size)[r], True),
    "gather": (lambda fn, x, c: fn(x, c.root), lambda xs, r, c: torch.cat(xs) if r == c.root else None, True),
    "all_gather": (lambda fn, x, c: fn(x), lambda xs, r, c: torch.cat(xs), True),
    "all_to_all": (lambda fn, x, c: fn(x), lambda xs, r, c: torch.cat([x.tensor_split(c.world_size)[r] for x in xs]), True),
}
ROOTED = {"broadcast", "reduce", "scatter", "gather"}
SUMS = {"all_reduce", "reduce_scatter", "reduce"}


# ----------------------------------------------------------------------------- running
class Launch(NamedTuple):
    """A case of a collective's Check: one launch of ``world_size`` ranks running ``cases`` (all of that
    world size) of a ``kind`` collective (see ``KINDS``), its failures naming ``name``; the traced
    ``pattern`` checked too (``PATTERNS``; None: the values only); ``allow``: the operations graded code
    may call."""
    world_size: int
    cases: list
    kind: str
    name: str
    pattern: str | None = None
    allow: frozenset = P2P_ONLY


def answer(fn, launch: Launch) -> list:
    """Inside a rank: (result, trace, input unchanged) of ``fn`` on every case of ``launch``, each under the
    trace and the guard (only ``launch.allow``)."""
    rank, dev = dist.get_rank(), device()
    call = KINDS[launch.kind][0]
    out = []
    for case in launch.cases:
        mark(str(case))
        x = make_input(case, rank).to(dev)       # the rank's device; compared on the CPU after
        before = x.clone()
        with trace() as t, guard(launch.allow, _WHY):
            y = call(fn, x, case)
        out.append((y, Trace(t.comm()), torch.equal(x, before)))
    return out


def verdict(launch: Launch, results: list) -> str | None:
    """The verdict on every rank's :func:`answer`: the values against torch, then the traced pattern."""
    return collective_problem(launch.name, launch.kind, launch.cases, results, launch.pattern)


def check(registry, name: str, launches, **options):
    """The ``"launch"`` Check ``name`` of ``registry`` whose cases are ``launches(**params)`` (:class:`Launch`\\ es)."""
    return registry.check(name, launches, answer, verdict, where="launch", world=lambda launch: launch.world_size,
                          launch={"forbidden_hint": FORBIDDEN_HINT}, **options)


# ----------------------------------------------------------------------------- comparing
def _show(t: torch.Tensor) -> str:
    if t.numel() <= 12:
        return str([round(v, 5) for v in t.double().tolist()])
    return f"tensor of {t.numel()} elements, first {[round(v, 4) for v in t[:6].double().tolist()]} ..."


def _compare(name, case, rank, got, want, exact, inputs=None, chunk=None):
    head = f"{name} ({case}): rank {rank}"
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{head} returned {type(got).__name__}; expected a tensor of shape {tuple(want.shape)}")
    if got.shape != want.shape:
        raise AssertionError(f"{head} returned shape {tuple(got.shape)}; expected {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{head} returned dtype {got.dtype}; expected {want.dtype} (same as the input)")
    tol = dict(rtol=0, atol=0) if exact else (
        dict(rtol=1e-5, atol=1e-5 * case.world_size) if want.dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10))
    if torch.allclose(got, want, **tol):
        return
    bad = (~torch.isclose(got, want, **tol)).nonzero().flatten()
    chunk_of = torch.cat([torch.full((c.numel(),), i) for i, c in enumerate(torch.arange(got.numel()).tensor_split(case.world_size))])
    chunks = sorted({int(chunk_of[i]) for i in bad}) if got.dim() == 1 else []
    raise AssertionError(
        f"{head} returned a wrong result: {len(bad)} of {got.numel()} elements differ"
        + (f" (in chunk(s) {chunks} of tensor_split({case.world_size}))" if chunks else "")
        + f".\n  expected (torch on the same inputs): {_show(want)}\n  got: {_show(got)}"
        + f"\n  max |error| = {(got.double() - want.double()).abs().max().item():.3g}"
        + (f"\n  {cause}" if inputs is not None and (cause := sum_of_which_inputs(
            got, inputs, rank, chunk, lambda a, b: torch.allclose(a, b.to(a.dtype), **tol))) else ""))


def check_results(name, kind, cases, results, seed=0, agree=None):
    """Compare every rank's result with torch's, case by case (raises AssertionError)."""
    ref = KINDS[kind][1]
    exact = KINDS[kind][2]
    agree = kind == "all_reduce" if agree is None else agree
    for i, case in enumerate(cases):
        xs = [make_input(case, r, seed) for r in range(case.world_size)]
        for r in range(case.world_size):
            got, _, unchanged = results[r][i]
            want = ref(xs, r, case)
            if want is not None:         # a sum: the diagnosis says which ranks' inputs each wrong chunk holds
                sums = dict(inputs=xs, chunk=r if kind == "reduce_scatter" else None) if kind in SUMS else {}
                _compare(name, case, r, got, want, exact, **sums)
            if not unchanged:
                raise AssertionError(f"{name} ({case}): rank {r} modified its input tensor; "
                                     f"work on a copy (tensor.clone()) and return a new tensor")
        if agree and any(not torch.equal(results[r][i][0], results[0][i][0]) for r in range(case.world_size)):
            raise AssertionError(f"{name} ({case}): the ranks' results are close to the sum but not identical; "
                                 f"after an all-reduce every rank must hold exactly the same tensor "
                                 f"(each chunk should be summed once and then copied)")


def collective_cases(kind: str, world_sizes, lengths, dtypes, roots=None, *, name: str,
                     pattern: str | None = None, allow=P2P_ONLY) -> list[Launch]:
    """One :class:`Launch` per world size: every length (a callable of the world size, or a number) x dtype
    (x root: 0, n//2 and n-1 by default for rooted collectives)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if pattern is not None and pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    out = []
    for n in world_sizes:
        ls = sorted({int(L(n)) if callable(L) else int(L) for L in lengths})
        rs = [None] if kind not in ROOTED else sorted(set(roots if roots is not None else (0, n // 2, n - 1)) & set(range(n)))
        out.append(Launch(n, [Case(n, L, dt, root) for L in ls for dt in dtypes for root in rs], kind, name, pattern,
                          frozenset(allow)))
    return out


def collective_problem(name, kind, cases, results, pattern=None, seed=0) -> str | None:
    """What is wrong with one launch's ``results`` (per rank, (result, trace, input unchanged) per
    case): the values against torch, then the traced pattern; None when nothing is."""
    try:
        check_results(name, kind, cases, results, seed)
        if pattern is not None:
            n = cases[0].world_size
            for i, case in enumerate(cases):      # with empty chunks, message counts legitimately vary
                if case.length >= n:
                    PATTERNS[pattern](name, case, merge(results[r][i][1] for r in range(n)))
    except AssertionError as err:
        return str(err)
    except (TypeError, IndexError, ValueError, AttributeError) as err:    # results of another shape than asked
        return f"{name}: the ranks' results are not (result, trace, unchanged) per case ({type(err).__name__}: {err})"
    return None
