"""Checks that run a case on groups of t ranks inside one launch (labs 5, 6, 8 and 9): the
groups, the loop over a test's cases, and how a failure names its case and rank. Cutting 4
ranks into groups of t = 1..4 lets one launch cover every group size a lab promises.

The likeliest cause of a wrong sum in a sub-group is a collective without ``group=`` (it runs
over the world): :func:`wrong_group_hint` says so when the observed value matches the same
sum over the world and not over the group.

A *judged* runner (:class:`RankRunner`) splits a case in two, as :mod:`minidist.checks.kit.docket`
asks: what the student's code did on this rank (its ``answer``, plain data) and the ``verdict``
on it, a function of the case, the rank and the answer alone that rebuilds the single-process
reference and the expected traffic itself. The rank gives the verdict at once (a failure shows
in the notebook as before); the answers travel back with the results and are filed in the
docket, so the grader's judge gives every verdict again (:func:`judged_on_ranks`)."""
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from minidist.checks.kit.launch import mark_case, one_thread
from minidist.checks.kit.docket import outcome
from minidist.runtime import plain_data
from minidist.runtime.device import device as rank_device
from minidist.trace import trace


class RankRunner(NamedTuple):
    """A judged case runner: ``answer(fn, case, r, t, group)`` runs the student's ``fn`` on this rank
    (rank r of a group of t) and returns what it did as plain data; ``verdict(case, r, t, answer)``
    lists the problems with it (None where all is well) without running any of the student's code."""
    answer: Callable
    verdict: Callable


def consecutive_groups(sizes, world_size: int) -> dict:
    """Inside a rank: {t: (group, my rank in it, its size)} for blocks of t consecutive ranks
    (t = 3 on 4 ranks leaves the last rank in a group of one; t = world_size is ``None``, the
    default group). Every rank creates every group, as ``dist.new_group`` requires."""
    out, rank = {}, dist.get_rank()
    for t in sorted(set(sizes)):
        if t == world_size:
            out[t] = (None, rank, world_size)
            continue
        for start in range(0, world_size, t):
            members = list(range(start, min(start + t, world_size)))
            group = dist.new_group(members)
            if rank in members:
                out[t] = (group, rank - start, len(members))
    # Past this barrier every rank has finished connecting to its groups. Without it a rank
    # whose cases send nothing (zigzag_shard) can exit while a peer is still connecting to it,
    # and the peer fails in new_group ("Gloo connectFullMesh failed"; seen once under load).
    dist.barrier()
    return out


def describe_case(case: dict) -> str:
    """A case's settings as a failure names them ("h=8, dtype=float64"), its group size t left out."""
    return ", ".join(f"{k}={getattr(v, '__name__', str(v).replace('torch.', ''))}" for k, v in case.items()
                     if k != "t") or "default sizes"


def run_cases_in_groups(progress, runner, fn, cases: list[dict], world_size: int, *,
                         stop_at_first_failure: bool = False) -> list:
    """Inside a rank: ``runner(fn, case, my rank in the group, t, group)`` for every case, on its
    group of ``case["t"]`` ranks, in order; [(my rank in the group, t, first problem or None)] per
    case. With ``stop_at_first_failure`` every rank stops after the first case that failed on any
    rank (a bug that deadlocks would otherwise cost each later case a timeout); the cases not
    run are reported as ``(None, t, None)``."""
    groups = consecutive_groups((c["t"] for c in cases), world_size)
    out = []
    with one_thread():
        for case in cases:
            group, r, t = groups[case["t"]]
            mark_case(progress, f"t={case['t']}: {describe_case(case)}")
            if isinstance(runner, RankRunner):
                out.append((r, t, *_judged_case(runner, fn, case, r, t, group)))
            else:
                out.append((r, t, first_problem(runner(fn, case, r, t, group))))
            if stop_at_first_failure:
                failed = torch.tensor([int(out[-1][2] is not None)], device=rank_device())
                dist.all_reduce(failed)
                if failed.item():
                    break
    return out + [(None, c["t"], None) for c in cases[len(out):]]


def _judged_case(runner: RankRunner, fn, case, r, t, group) -> tuple:
    """(first problem, the answer as plain data) of one case on this rank: the verdict is given on the
    answer after its round trip through plain data, the value the judge reads."""
    try:
        data = plain_data.dumps(runner.answer(fn, case, r, t, group))
    except TypeError as err:
        return f"returned something that is not plain data ({err})", None
    return first_problem(runner.verdict(case, r, t, plain_data.loads(data))), data


def first_problem(problems) -> str | None:
    return next((p for p in problems if p), None)


def raise_first_group_problem(name: str, cases: list[dict], results: list, world_size: int,
                              judged=None, params: dict | None = None) -> None:
    """``results[rank][i]`` is ``(rank in its group, t, problem or None[, answer])`` for case i: file the
    answers of a ``judged`` check (made with :func:`judged_on_ranks`) and raise for the first problem."""
    for i, case in enumerate(cases):
        for rank in range(world_size):
            r, t, problem, *answer = results[rank][i]
            if judged is not None and answer and answer[0] is not None:
                problem = problem or judged.file(params, i * world_size + rank, answer[0])
            if problem:
                raise AssertionError(group_problem(name, case, rank, r, t, problem))


def group_problem(name: str, case: dict, rank: int, r: int, t: int, problem: str) -> str:
    return f"{name} (t={t}, {describe_case(case)}), rank {rank} (rank {r} of its group): {problem}"


def rank_cases(cases: list[dict], world_size: int) -> list[tuple]:
    """(case, world rank, rank in its group, group size) for every case and rank: the order in which
    a judged check files its answers (index = case index × world size + world rank)."""
    out = []
    for case in cases:
        for rank in range(world_size):
            start = rank - rank % case["t"]
            out.append((case, rank, rank - start, min(case["t"], world_size - start)))
    return out


def judged_on_ranks(name: str, cases: Callable[[bool], list], runner: RankRunner, world_size: int) -> tuple:
    """The ``(cases(hidden), verdict)`` of a graded function run on ranks, for a
    :meth:`~minidist.checks.kit.docket.Judged.of_functions` table: one case per (case, rank)."""
    def verdict(case, answer):
        problem = first_problem(runner.verdict(case[0], case[2], case[3], answer))
        return group_problem(name, *case, problem) if problem else None
    return (lambda hidden: rank_cases(cases(hidden), world_size)), verdict


def wrong_group_hint(got, group_value, world_value, t: int, world_size: int, rtol: float = 1e-4) -> str:
    """The diagnosis of a wrong result in a group of ``t`` ranks: " It equals the sum over all 4 ranks
    (the world), not over the 2 of its group: ..." when ``got`` matches ``world_value`` (the same
    computation over every rank) and not ``group_value``; "" otherwise (or when the group is the world)."""
    if t == world_size or not all(isinstance(v, torch.Tensor) for v in (got, group_value, world_value)):
        return ""
    if got.shape != world_value.shape or got.shape != group_value.shape:
        return ""
    got, group_value, world_value = (v.detach().double().cpu() for v in (got, group_value, world_value))
    atol = rtol * max(1.0, world_value.abs().max().item())
    if torch.allclose(got, world_value, rtol=rtol, atol=atol) and not torch.allclose(got, group_value, rtol=rtol,
                                                                                       atol=atol):
        return (f" It equals the sum over all {world_size} ranks (the world), not over the {t} ranks of its "
                f"group: a collective ran without group= (the default group is the world).")
    return ""


def attempt(fn, args, kwargs=None) -> dict:
    """The answer to a case whose call must raise ValueError before any message: what the call did
    (:func:`minidist.checks.kit.docket.outcome`) and the operations it traced."""
    with trace() as tr:
        done = outcome(lambda: fn(*args, **(kwargs or {})))
    return {**done, "communicated": sorted({e.op for e in tr.comm()})}


def raise_verdict(answer: dict, what: str) -> list:
    """The verdict on an :func:`attempt`: a ValueError, raised before any message, because ``what``."""
    if answer.get("raised") == "ValueError":
        return [None if not answer["communicated"] else
                f"raised ValueError only after communicating ({', '.join(answer['communicated'])}): check {what} "
                "first, before any message (the other ranks would wait for you)"]
    if "raised" in answer:
        return [f"raised {answer['raised']} ({str(answer.get('message'))[:120]}) although {what}; the lab asks for "
                "a ValueError with a clear message, before any message"]
    return [f"returned although {what}; the lab asks for a ValueError"]

