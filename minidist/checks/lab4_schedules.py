"""Lab 4's schedule check (:func:`check_schedule`, re-exported by
:mod:`minidist.checks.lab4_pipeline`, which the notebook imports) and the refusal every lab 4
check applies.

A schedule is data (as in ``torch.distributed.pipelining``): per rank, a list of forward,
backward, send and receive actions. It must pass the validator (:func:`minidist.pipeline.validate`,
deadlock included), have GPipe's (Huang et al. 2019) or 1F1B's (Narayanan et al. 2021) canonical
compute order, and its simulated bubble and peak activations must equal the formulas of
:mod:`minidist.cost` exactly: bubble (p-1)/(m+p-1), peak m (GPipe) or min(p - rank, m) (1F1B)
micro-batches. Pure Python, no ranks; judged (:mod:`minidist.checks.kit.docket`).
"""
from __future__ import annotations

from minidist.checks.kit.launch import report_passed
from minidist.checks.kit.refusal import graded_call
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.docket import Judged, judged
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.kit.returned import require_plain
from minidist.cost import pipeline_bubble, pipeline_peak_activations
from minidist.pipeline import Costs, Schedule, make, simulate, validate

#: minidist's schedule builders (make, gpipe, one_f_one_b, with_comms, ...) and executor (run_schedule)
#: are refused in graded code; Action, Schedule and timed are the lab's building blocks.
REFUSED = Refusal("pipeline schedules and their executor",
                  ("minidist.pipeline.schedules", "minidist.pipeline.executor"),
                  allow=("minidist.pipeline.schedules.Action", "minidist.pipeline.schedules.Schedule",
                         "minidist.pipeline.executor.timed", "minidist.pipeline.executor.StepStats"),
                  checks="minidist.checks.lab4_pipeline")
SCHEDULE_CASES = {                     # (p, m)
    False: [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8)],
    True: [(1, 1), (1, 3), (2, 7), (3, 1), (3, 2), (3, 5), (4, 3), (5, 3), (5, 8), (6, 12)],
}


# ----------------------------------------------------------------------------- schedules
def _canonical(kind: str, p: int, m: int, r: int) -> list[tuple[str, int]]:
    return [(a.kind, a.mb) for a in make(kind, p, m).compute(r)]


def _show(order, limit=14):
    text = " ".join(f"{k}{mb}" for k, mb in order[:limit])
    return text + (" ..." if len(order) > limit else "")


def _order_problem(where, kind, s, p, m) -> str | None:
    for r in range(p):
        got = [(a.kind, a.mb) for a in s.compute(r)]
        want = _canonical(kind, p, m, r)
        if kind == "gpipe":       # any backward order is a GPipe; forwards in order, all first
            ok = got[:m] == want[:m] and sorted(got[m:]) == sorted(want[m:])
            hint = "GPipe runs all m forwards (micro-batches 0, 1, ..., m-1), then all m backwards"
        else:
            ok = got == want
            warm = next((i for i, (k, _) in enumerate(got) if k == "B"), len(got))
            hint = (f"rank {r} runs {warm} forward(s) before its first backward; 1F1B's warmup is "
                    f"min(p - rank - 1, m) = {min(p - r - 1, m)} forwards, then one forward and one "
                    f"backward per step, then the remaining backwards")
        if not ok:
            return (f"{where}: rank {r}'s compute order is not {kind}'s.\n"
                    f"  expected: {_show(want)}\n  got:      {_show(got)}\n  {hint}")
    return None


def _schedule_cases(kind: str, hidden: bool) -> list[tuple]:
    if kind not in ("gpipe", "1f1b"):
        raise ValueError(f"check_schedule knows 'gpipe' and '1f1b', not {kind!r}")
    return [(kind, p, m) for p, m in SCHEDULE_CASES[hidden]]


def _schedule_verdict(case, s) -> str | None:
    kind, p, m = case
    where = f"{kind} schedule(p={p}, m={m})"
    if not isinstance(s, Schedule):
        return f"{where}: returned {type(s).__name__}; expected a minidist.pipeline.Schedule"
    if (s.p, s.m, s.v) != (p, m, 1):
        return (f"{where}: returned a schedule for p={s.p}, m={s.m}, v={s.v}; expected p={p}, m={m}, v=1 (every "
                f"micro-batch is its own unit of work)")
    try:
        problems = validate(s)
    except (TypeError, AttributeError, IndexError, ValueError) as err:     # actions that are not Actions
        problems = [f"{type(err).__name__}: {err}"]
    if problems:
        more = f"\n  ... and {len(problems) - 6} more" if len(problems) > 6 else ""
        return f"{where} is not a valid schedule:\n  " + "\n  ".join(problems[:6]) + more
    problem = _order_problem(where, kind, s, p, m)
    if problem:
        return problem
    sim = simulate(s, Costs(F=1, B=2))
    theory = pipeline_bubble(kind, p, m)
    if abs(sim.bubble - theory) > 1e-9:
        return (f"{where}: simulated bubble {sim.bubble:.4f}, theory (p-1)/(m+p-1) = {theory:.4f}. Are the sends "
                f"placed right after the compute that produces them, and the receives right before the compute "
                f"that needs them?")
    want = [pipeline_peak_activations(kind, p, m, r) for r in range(p)]
    if sim.peak_activations != want:
        return f"{where}: peak micro-batch activations per rank {sim.peak_activations}, expected {want}"
    return None


JUDGED_SCHEDULE = Judged(__name__, "schedule", _schedule_cases, _schedule_verdict, params=("kind", "hidden"))


@judged(JUDGED_SCHEDULE)
@passes_quietly
def check_schedule(fn, kind: str, hidden: bool = False, name: str | None = None) -> None:
    """``fn(p, m)`` must return a valid ``kind`` schedule ("gpipe" or "1f1b"): validator
    clean (deadlock included), canonical compute order, simulated bubble = theory and
    simulated peak activations per rank = theory."""
    cases = JUDGED_SCHEDULE.cases(kind=kind, hidden=hidden)
    name = name or getattr(fn, "__name__", kind)
    for i, case in enumerate(cases):
        _, p, m = case
        s = graded_call(REFUSED, name, fn, p, m)
        require_plain(f"{name}(p={p}, m={m})", s)
        JUDGED_SCHEDULE.require(dict(kind=kind, hidden=hidden), i, case, s)
    shown = ", ".join(f"{p}/{m}" for p, m in SCHEDULE_CASES[hidden])
    report_passed(name, f"p/m = {shown}: valid, {kind}'s compute order, bubble and peak = theory", hidden)
