"""Lab 4's measurements for the notebook's demo cells (not graded): the student's executor on p ranks,
its activations, its bubble measured in sleep-compute mode and replayed at fixed costs, next to the
simulator and the theory (:func:`measure_executor`, the rows ``minidist.plots.plot_bubble_vs_m`` plots).

The runs are the memory check's (:func:`minidist.checks.lab4_pipeline.answers.memory_runs`), under
the lab's refusal; outputs land as the backend writes them (no ``outputs_at_wait``: its handles would
keep the receive buffers alive, and the memory is what is measured).
"""
from __future__ import annotations

from minidist.checks.kit.launch import TIMEOUT, launch_named, mark_case
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab4_pipeline import answers
from minidist.checks.lab4_pipeline.cases import SLEEP, Case, schedules
from minidist.checks.lab4_pipeline.verdicts import measured_rows
from minidist.pipeline import Costs


@passes_quietly
def measure_executor(fn, p: int, cases, costs: Costs = SLEEP, repeats: int = 1, timeout: float = TIMEOUT,
                     name: str | None = None, sleep: bool = True, refused: Refusal | None = None) -> list[dict]:
    """Run ``fn`` on p ranks for each (schedule, m, batch) in ``cases``: measured peak
    activations (micro-batches and bytes) per rank; the bubble of a sleep-compute run
    (``measured``: the smallest of ``repeats``, whose timeline is ``slots``; None without
    ``sleep``); and ``replayed``, the bubble of the run's traced order replayed at ``costs``,
    which load does not change; ``kept``, per rank, at each backward, how many finished
    micro-batches still had their stage input or output alive
    (:func:`minidist.harness.pipeline.kept_at_each_backward`). One dict per case, with the theory
    and the simulator's bubble next to it (keys as ``minidist.plots.plot_bubble_vs_m`` wants them).
    Outputs land as the backend writes them here (no ``outputs_at_wait``: its handles would keep the
    receive buffers alive); ``check_run_pipeline`` checks the waits. ``refused``: the lab's refusal."""
    name = name or getattr(fn, "__name__", "executor")
    runs = tuple(Case(kind, m, batch) for kind, m, batch in cases)
    built = schedules((p, runs))                # the library's schedules, outside the refusal
    results = launch_named(_measured, p, fn, runs, costs if sleep else None, repeats, built, name=name,
                           timeout=timeout, refuse=refused, outputs_at_wait=False)
    return measured_rows(results, p, runs, costs, repeats, sleep)


def _measured(progress, fn, runs, costs, repeats, built):
    return answers.memory_runs(fn, runs, costs, repeats, built, lambda text: mark_case(progress, text))
