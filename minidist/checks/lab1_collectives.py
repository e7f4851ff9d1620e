"""Lab 1's checks (collectives from send/recv): each graded function, its cases and pattern.

A test cell of the lab is a one-liner::

    checks.check_function("ring_all_reduce", ring_all_reduce)       # correctness
    checks.check_pattern("ring_all_reduce", ring_all_reduce)        # traced communication
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.checks.kit.collectives import P2P_ONLY, collective_cases, collective_problem, run_collective_cases
from minidist.checks.kit.launch import COLLECTIVE_CHECK_TIMEOUT, launch_named, mark_case, report_passed
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, from_raising, judged
from minidist.checks.kit.quiet import passes_quietly
from minidist.runtime import device
from minidist.trace import guard

#: minidist's own collectives (wrappers, ``__wrapped__``, inner helpers) are refused in graded code.
REFUSED = Refusal("collectives from send/recv", ("minidist.collectives",), checks=__name__)

LAB1 = {   # graded function -> (kind, pattern, power-of-two world sizes only)
    "broadcast": ("broadcast", None, False),
    "naive_all_reduce": ("all_reduce", "naive", False),
    "ring_reduce_scatter": ("reduce_scatter", "ring_reduce_scatter", False),
    "ring_all_reduce": ("all_reduce", "ring", False),
    "recursive_halving_all_reduce": ("all_reduce", "halving", True),
}


def _function_cases(name: str, hidden: bool) -> list[tuple]:
    """(name, world size, its cases) per launch of ``check_function``."""
    kind, _, pow2 = LAB1[name]
    if hidden:
        sizes = (1, 2, 4) if pow2 else (1, 2, 3, 4, 5)
        lengths, dtypes = (1, lambda n: n - 1, lambda n: 2 * n + 1, lambda n: 4 * n, 37), (torch.float32, torch.float64)
    else:
        sizes, lengths, dtypes = ((2, 4) if pow2 else (2, 3, 4)), (8, 10), (torch.float32,)
    return [(name, n, cases) for n, cases in collective_cases(kind, sizes, lengths, dtypes)]


def _pattern_cases(name: str) -> list[tuple]:
    kind, pattern, pow2 = LAB1[name]
    if pattern is None:
        raise ValueError(f"lab 1 has no pattern test for {name}")
    return [(name, n, cases) for n, cases in collective_cases(kind, (2, 4) if pow2 else (2, 3, 4),
                                                              (lambda n: 8 * n + 3,), (torch.float32,))]


# Judged (minidist.checks.kit.docket): a case is one launch; the answer is every rank's (result, trace,
# input unchanged), compared with torch on the same inputs here and again by the grader's judge.
JUDGED_FUNCTION = Judged(__name__, "function", _function_cases,
                         lambda case, results: collective_problem(case[0], LAB1[case[0]][0], case[2], results),
                         params=("name", "hidden"))
JUDGED_PATTERN = Judged(__name__, "pattern", _pattern_cases,
                        lambda case, results: collective_problem(case[0], LAB1[case[0]][0], case[2], results,
                                                                 LAB1[case[0]][1]), params=("name",))


def _run_judged(judged_check, params, fn, timeout):
    name = params["name"]
    for i, case in enumerate(judged_check.cases(**params)):
        results = run_collective_cases(fn, LAB1[name][0], case[2], name=name, timeout=timeout, refuse=REFUSED)
        judged_check.require(params, i, case, results)


@judged(JUDGED_FUNCTION)
@passes_quietly
def check_function(name: str, fn, hidden: bool = False, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """Correctness of lab 1's graded function ``name``. Visible: a few shapes; hidden:
    world sizes 1-5 (1, 2, 4 for halving: the lab's contract says N >= 1), lengths
    divisible by N, not, and below N, float32 and float64."""
    _run_judged(JUDGED_FUNCTION, dict(name=name, hidden=hidden), fn, timeout)
    cases = JUDGED_FUNCTION.cases(name=name, hidden=hidden)
    dtypes = sorted({str(c.dtype).replace("torch.", "") for _, _, launch in cases for c in launch})
    report_passed(name, f"N={_sizes(n for _, n, _ in cases)}, lengths {'1, N-1, 2N+1, 4N, 37' if hidden else '8, 10'}, "
                        f"{'/'.join(dtypes)}: every rank's result vs torch, input unchanged", hidden)


def _sizes(sizes) -> str:
    return ", ".join(map(str, sizes))


@judged(JUDGED_PATTERN)
@passes_quietly
def check_pattern(name: str, fn, timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """The traced communication pattern of lab 1's graded function ``name``."""
    _run_judged(JUDGED_PATTERN, dict(name=name), fn, timeout)
    report_passed(name, f"N={_sizes(n for _, n, _ in _pattern_cases(name))}: traced messages "
                        f"({_PATTERN_WORDS[LAB1[name][1]]})")


_PATTERN_WORDS = {"naive": "through rank 0, 2(N-1)·S bytes in all",
                  "ring_reduce_scatter": "ring neighbours only, (N-1)/N·S bytes each way",
                  "ring": "ring neighbours only, 2(N-1)/N·S bytes each way",
                  "halving": "partners rank XOR 1, 2, 4, ... and back, sizes S/2, S/4, ..."}


def _rejects_body(progress, fn):
    mark_case(progress, f"world_size={dist.get_world_size()}, length 8, float32")
    try:
        with guard(P2P_ONLY, "graded collectives must be built from dist.send/recv/isend/irecv only"):
            fn(torch.ones(8, device=device()))
    except ValueError as err:
        return ("ValueError", str(err))
    return ("returned", None)


def _rejected(run, out) -> None:
    name, n = run
    silent = [r for r, (what, _) in enumerate(out) if what != "ValueError"]
    if silent:
        raise AssertionError(f"{name} (world_size={n}): ranks {silent} returned instead of raising ValueError; "
                             f"the lab asks for a ValueError that says N must be a power of two")


#: Judged (minidist.checks.kit.docket): every rank's outcome is filed; the grader's judge reads it again
JUDGED_REJECTS = Judged(__name__, "rejects world size", lambda name, world_sizes: [(name, n) for n in world_sizes],
                        from_raising(_rejected), params=("name", "world_sizes"))


@judged(JUDGED_REJECTS)
@passes_quietly
def check_rejects_world_size(name: str, fn, world_sizes=(3, 6), timeout: float = COLLECTIVE_CHECK_TIMEOUT) -> None:
    """The lab's promise for ``name`` (recursive halving): on a world size that is not a
    power of two it raises ``ValueError`` on every rank, before it communicates (a rank
    that goes ahead and waits for a partner that raised would hang)."""
    JUDGED_REJECTS.run(dict(name=name, world_sizes=world_sizes), lambda run: launch_named(
        _rejects_body, run[1], fn, name=name, timeout=timeout, refuse=REFUSED))
    report_passed(f"{name} rejects N={_sizes(world_sizes)}", "ValueError on every rank before any message", True)
