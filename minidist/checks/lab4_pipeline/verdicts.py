"""Lab 4's verdicts: a schedule against the validator, its kind's compute order and the formulas of
:mod:`minidist.cost`; the executor's gradients and loss against single-process autograd, and what
it left of its inputs; its activations, what it kept and its replayed bubble against the schedule.

Every reference is rebuilt here from the case (the library's schedules, the seeded model and batch).
A verdict returns its first problem, None when there is none (an answer it cannot read, or from
another number of ranks, is the Check's problem: :meth:`~minidist.checks.kit.check.Check.found`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist.checks.kit.compare import digest, tensor_error, untouched
from minidist.checks.kit.returned import returned_problem
from minidist.checks.kit.launch import TOL
from minidist.checks.lab4_pipeline.cases import EXECUTOR_FUNCTION, SLEEP, WIDTH, inputs, schedule_state
from minidist.cost import pipeline_bubble, pipeline_peak_activations
from minidist.pipeline import (Costs, Schedule, bubble_of, make, partition, rank_chunks, replayed_slots, simulate,
                               slots_from_trace, validate)
from minidist.trace import merge

# ----------------------------------------------------------------------------- schedules
def _show(order, limit=14):
    text = " ".join(f"{k}{mb}" for k, mb in order[:limit])
    return text + (" ..." if len(order) > limit else "")


def _order_problem(where, kind, s, p, m) -> str | None:
    for r in range(p):
        got = [(a.kind, a.mb) for a in s.compute(r)]
        want = [(a.kind, a.mb) for a in make(kind, p, m).compute(r)]
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


def schedule(case, answer) -> str | None:
    """The schedule the builder returned for (kind, p, m): valid (deadlock included), the kind's
    compute order, the simulated bubble and peak activations per rank of the theory, exactly."""
    kind, p, m = case
    where = f"{kind} schedule(p={p}, m={m})"
    if problem := returned_problem(answer):
        return f"{where}: {problem}" if "foreign" not in answer else problem
    s = answer["returned"]
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


# ----------------------------------------------------------------------------- executor
def executor(case, answers) -> str | None:
    """Every rank's steps of a launch (world, runs) against single-process autograd on the same model
    and batch; the schedule, the batch and the weights as the caller gave them."""
    world, runs = case
    for i, run in enumerate(runs):
        problem = _run_problem(EXECUTOR_FUNCTION, world, run, [answers[r][i] for r in range(world)],
                               steps=2 if i == 0 else 1)
        if problem:
            return problem
    return None


def _run_problem(name, world, run, results, steps: int) -> str | None:
    """One run's steps on every rank (``results``, by rank) against one process on the same model and batch."""
    p, m = run.p or world, run.m
    where = f"{name} with {run.kind}(p={p}, m={m}), batch of {run.batch}" + (
        "" if run.dtype == torch.float32 else f" in {run.dtype}")
    model, x, y = inputs(p, run)
    ref_loss = F.mse_loss(model(x), y)          # a forward and a backward change neither the batch nor the weights
    ref_loss.backward()
    stages, given = partition(model, p), schedule_state(make(run.kind, p, m))
    for r in range(p):
        chunk = rank_chunks(stages, p, r)[0]
        if not isinstance(results[r], list) or len(results[r]) not in (1, steps):
            return f"{where}: rank {r} answered {results[r]!r:.80}, not the {steps} step(s) the check ran"
        for step, result in enumerate(results[r]):
            at = where if step == 0 else f"{where}, step 2 (the same schedule object again)"
            changed = _changed(result, given, x, y, chunk)
            if changed:
                return f"{at}: on rank {r}, {changed}"
            problem = _step_problem(at, r, p, m, result, chunk, ref_loss.item())
            if problem:
                return problem
        if len(results[r]) != steps:            # only a step that changed its inputs stops early
            return f"{where}: rank {r} ran {len(results[r])} step(s), the check asked for {steps}"
    return None


def _changed(result, given: dict, x, y, chunk) -> str | None:
    """What the step changed that the caller owns: the schedule, the batch, the weights."""
    after = result["schedule"]
    if after != given:
        return (f"the schedule it was given changed during the call (actions per rank: "
                f"{given['lengths']} before, {(after or {}).get('lengths') or []} after); a schedule is data "
                f"that a training loop runs again every step: read it, do not consume or edit it")
    if problem := untouched({"x": result["x"], "y": result["y"]}, {"x": x, "y": y}):
        return problem
    if list(result["weights"]) != [digest(q) for q in chunk.parameters()]:
        return "the stage's weights changed during the call: the executor computes gradients, it takes no step"
    return None


def _step_problem(where, r, p, m, result, chunk, ref_loss: float) -> str | None:
    """One step's gradients on rank r (within ``TOL`` of one process's: every reference gradient of
    these cases is below 1, so the kit's relative tolerance is TOL absolute) and its loss."""
    grads, named = result["grads"], list(chunk.named_parameters())
    if len(grads) != len(named) or any(g is None for g in grads):
        return (f"{where}: rank {r} has parameters without a gradient; every "
                f"stage's backward must reach its weights")
    for g, (pname, q) in zip(grads, named):
        problem = tensor_error(f"rank {r}'s gradient of {pname}", g, q.grad, tol=TOL,
                               against="single-process training")
        if problem:
            norm = q.grad.norm().item()         # the hint reads the failing parameter's |grad| ratio
            ratio = g.double().norm().item() / norm if isinstance(g, torch.Tensor) and norm > 0 else float("nan")
            hint = ""
            if abs(ratio - m) < 1e-3 * m and m > 1:
                hint = (f" The gradients are {m}x too large: the loss of each micro-batch must be "
                        f"scaled by 1/m, so that m accumulated gradients average, not sum.")
            elif ratio < 0.99:
                hint = (" Too small: are gradients of some micro-batches lost (overwritten, or "
                        ".grad zeroed between micro-batches)?")
            return f"{where}: {problem}, |grad| ratio {ratio:.3f}.{hint}"
    loss = result["loss"]
    if r == p - 1:
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not abs(loss - ref_loss) <= TOL:
            hint = (" With p = 1 the one stage is both the first and the last: it reads the batch and "
                    "computes the loss." if p == 1 else "")
            return (f"{where}: the last stage (rank {r}) returned loss {loss}, "
                    f"expected the full-batch loss {ref_loss:.6f} "
                    f"(sum of the m micro-batch losses, each scaled by 1/m).{hint}")
    elif loss is not None:
        return (f"{where}: rank {r} returned {loss!r}; only the rank holding the "
                f"last stage has a loss, the others return None")
    return None


# ----------------------------------------------------------------------------- memory and bubble
def measured_rows(results, p: int, runs, costs: Costs, repeats: int, sleep: bool) -> list[dict]:
    """The rows of every rank's :func:`~minidist.checks.lab4_pipeline.answers.memory_runs` (``results``,
    by rank, as plain data): per run, the peaks per rank next to the theory, the timeline, the measured
    bubble (sleep-compute runs), the replayed one and the simulator's (keys as
    ``minidist.plots.plot_bubble_vs_m`` wants them)."""
    rows = []
    for i, run in enumerate(runs):
        kind, m, batch = run.kind, run.m, run.batch
        measured, timelines, replayed = [], [], None
        for k in range(repeats):
            merged = merge(results[r][i][3][k] for r in range(p))
            slots = slots_from_trace(merged)
            measured.append(bubble_of(slots, p) if slots and sleep else None)
            timelines.append(slots)
            if k == 0 and slots:
                replayed = bubble_of(replayed_slots(merged, costs), p)
        rows.append(dict(schedule=kind, p=p, m=m, batch=batch,
                         peak_microbatches=[results[r][i][0] for r in range(p)],
                         peak_bytes=[results[r][i][1] for r in range(p)],
                         microbatch_bytes=[results[r][i][2] for r in range(p)],
                         kept=[results[r][i][4] for r in range(p)],
                         theory_microbatches=[pipeline_peak_activations(kind, p, m, r) for r in range(p)],
                         measured=None if None in measured else min(measured),
                         slots=timelines[measured.index(min(measured))] if None not in measured else timelines[0],
                         replayed=replayed,
                         simulated=simulate(make(kind, p, m), costs).bubble,
                         theory=pipeline_bubble(kind, p, m, t_f=costs.F, t_b=costs.B)))
    return rows


KEPT_SLACK = 1      # finished micro-batches a stage may still hold when a backward begins (a loop variable)


def _kept_problem(where, row, p, m) -> str | None:
    """Between micro-batches a stage holds what the schedule has in flight (and what it has sent):
    a micro-batch whose backward has run must let go of its stage input (a received buffer) and output."""
    act = row["batch"] // m * WIDTH * 4
    for r in range(p):
        kept = row["kept"][r]
        if kept and max(kept) > KEPT_SLACK:
            k = kept.index(max(kept))
            mb = [a.mb for a in make(row["schedule"], p, m).compute(r) if a.kind == "B"][k]
            return (f"{where}: when the backward of micro-batch {mb} began, rank {r} still held the stage input or "
                    f"output of {max(kept)} micro-batches whose backward had already run (~{max(kept) * act} bytes of "
                    f"activations; {row['schedule']} needs at most {row['theory_microbatches'][r]} micro-batches in "
                    f"flight on this rank). Forget each micro-batch's stage input (its receive buffer) and output "
                    f"once its backward has run.")
    return None


def memory(case, answers) -> str | None:
    """The activations, what is kept and the replayed bubble of every rank's runs (p = 4, m = 8)."""
    p, runs = case
    for row in measured_rows(answers, p, runs, SLEEP, 1, False):
        problem = _memory_problem(f"{EXECUTOR_FUNCTION} with {row['schedule']}(p={p}, m={row['m']})", row, p, row["m"])
        if problem:
            return problem
    return None


def _memory_problem(where, row, p, m) -> str | None:
    if row["peak_microbatches"] != row["theory_microbatches"]:
        return (f"{where}: autograd held the activations of {row['peak_microbatches']} "
                f"micro-batches at the peak (per rank); {row['schedule']} needs "
                f"{row['theory_microbatches']}. Drop every reference to a micro-batch's "
                f"stage input and output once its backward has run.")
    for r in range(p):
        want = row["theory_microbatches"][r] * row["microbatch_bytes"][r]
        if row["peak_bytes"][r] != want:
            return (f"{where}: rank {r} held {row['peak_bytes'][r]} bytes of activations at "
                    f"the peak; {row['theory_microbatches'][r]} micro-batches of "
                    f"{row['batch'] // m} rows hold {want}. Is every micro-batch 1/m of the batch?")
    if problem := _kept_problem(where, row, p, m):
        return problem
    if row["replayed"] is None:
        return (f"{where}: no compute was recorded on the timeline. "
                f"Run every F and B inside `with timed(action, costs):`.")
    if abs(row["replayed"] - row["simulated"]) > 1e-9:
        return (f"{where}: your run, replayed in its own order with F={SLEEP.F}s and B={SLEEP.B}s "
                f"and free messages, has a bubble of {row['replayed']:.3f}; the schedule's is "
                f"{row['simulated']:.3f}. Do ranks wait for messages they do not need yet, "
                f"synchronise more than the schedule asks, or compute out of the schedule's order?")
    return None
