"""Every bug of a lab's bank, checked in one kernel: the fast half of ``selftest --quick``.

A full selftest grades each bug as its own nbgrader submission (a fresh kernel and the whole
notebook, ~30 s each), which is the authoritative check and takes many minutes per lab.
Here one kernel runs the solution notebook (with its hidden tests) once; then, for each bug,
it re-runs the broken solution cell and the test cells the bug must fail, scores them with
nbgrader's own ``determine_grade``, and restores the correct cell.

That is faithful as long as test cells call the graded functions (the labs' convention:
each test cell is a one-liner handing the function to a ``minidist.checks`` module), because a
re-defined function is what the test then calls.
"""
from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager

from nbclient import NotebookClient
from nbgrader.utils import determine_grade

from autograder.notebooks import skip_demos
from autograder.course import KERNEL_NAME, cell_timeout, grade_id, kernel_argv, nbg, strip_solution_markers

# Deadlock bugs fail through the checks' launch timeout; a few seconds is plenty to show a
# deadlock on a quiet machine, and keeps a bank of deadlocks from taking minutes.
QUICK_CHECK_TIMEOUT = "4"


@contextmanager
def _env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def graded_notebook(source_nb, solution_nb):
    """The solution submission with the source's test cells (hidden tests included), as autograde sees it."""
    tests = {grade_id(c): c for c in source_nb.cells if nbg(c).get("grade") and not nbg(c).get("solution")}
    nb = copy.deepcopy(solution_nb)
    for cell in nb.cells:
        if grade_id(cell) in tests:
            cell.source = strip_solution_markers(tests[grade_id(cell)].source)
    return nb


def check_bugs(name: str, nb, bugs: list[dict], inject, workdir: str) -> tuple[list[str], dict[str, tuple[list[str], float]]]:
    """Run ``nb`` once, then each bug. Returns (baseline problems, {bug: (tests it did not fail, seconds)})."""
    kernel_argv()   # installs the pinned kernel if it is missing
    nb = skip_demos(copy.deepcopy(nb))
    index = {grade_id(c): i for i, c in enumerate(nb.cells) if grade_id(c)}
    # nbclient writes executed cells back into the notebook it holds: give it its own copy,
    # so bugs are injected into, and cells restored from, the untouched one.
    client = NotebookClient(copy.deepcopy(nb), kernel_name=KERNEL_NAME, timeout=cell_timeout(), allow_errors=True,
                            resources={"metadata": {"path": workdir}},
                            extra_arguments=["--IPKernelApp.capture_fd_output=False"])

    def run(cell, i):
        cell = copy.deepcopy(cell)
        cell.outputs = []
        client.execute_cell(cell, i)
        return cell

    def score(cell):
        points, max_points = determine_grade(cell)
        return points is not None and points >= max_points

    results = {}
    with _env(NBGRADER_EXECUTION="autograde", MINIDIST_CHECK_TIMEOUT=QUICK_CHECK_TIMEOUT):
        with client.setup_kernel():
            baseline = []
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                done = run(cell, i)
                if nbg(cell).get("grade") and not nbg(cell).get("solution") and not score(done):
                    baseline.append(f"{grade_id(cell)} fails on the solution")
            if baseline:
                return baseline, results
            for bug in bugs:
                start = time.perf_counter()
                broken = inject(bug, {name: nb})[name]
                i = index[bug["cell"]]
                run(broken.cells[i], i)
                missed = [t for t in bug["catches"] if score(run(nb.cells[index[t]], index[t]))]
                run(nb.cells[i], i)     # the correct cell again, for the next bug
                results[bug["name"]] = (missed, time.perf_counter() - start)
    return [], results
