"""Every bug of a lab's bank, checked in a running kernel: the fast half of ``selftest --quick``.

A full selftest grades each bug as its own nbgrader submission (a fresh kernel and the whole
notebook, ~30 s each), which is the authoritative check and takes many minutes per lab.
Here a kernel runs the solution notebook's code cells once, without its tests (the selftest
grades the solution through nbgrader meanwhile, confirmation included: running its tests here
too would run them a third time); then, for each bug, it re-runs the broken solution cell and
the test cells the bug must fail, scores them with nbgrader's own ``determine_grade``, and
restores the correct cell. A correct alternative goes the same way, except that its tests must
pass. The bank is shared between two such kernels (see ``KERNELS``).

That is faithful as long as test cells call the graded functions (the labs' convention:
each test cell is a one-liner handing the function to a ``minidist.checks`` module), because a
re-defined function is what the test then calls.
"""
from __future__ import annotations

import copy
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import nbformat
from nbclient import NotebookClient
from nbgrader.utils import determine_grade

from minidist.protocol import CHECK_TIMEOUT_ENV, TIMEOUT_SCALE_ENV
from autograder.course.cells import grade_id, nbg, skip_demos, strip_solution_markers
from autograder.course.config import cell_timeout
from autograder.course.kernel import KERNEL_NAME, kernel_argv
from autograder.grading.worker.retry import RETRY_TIMEOUT_SCALE

# Deadlock bugs fail through the checks' launch timeout, which the kernels shorten: a few
# seconds keep a bank of deadlocks from taking minutes. The solution and the alternatives must
# pass, so they get more room on a loaded machine than a bug, whose launches run at half that
# (MINIDIST_TIMEOUT_SCALE, read at each launch): a bug must fail anyway, and one that only
# timed out here still has to fail in the full selftest, with the real timeouts.
QUICK_CHECK_TIMEOUT = "4"
BUG_TIMEOUT_SCALE = 0.5
# A bank spends much of its time idle, waiting out those timeouts: two kernels take turns on
# the CPU.
KERNELS = 2


def graded_notebook(source_nb, solution_nb):
    """The solution submission with the source's test cells (hidden tests included), as autograde sees it."""
    tests = {grade_id(c): c for c in source_nb.cells if nbg(c).get("grade") and not nbg(c).get("solution")}
    nb = copy.deepcopy(solution_nb)
    for cell in nb.cells:
        if grade_id(cell) in tests:
            cell.source = strip_solution_markers(tests[grade_id(cell)].source)
    return nb


def _is_test(cell) -> bool:
    return bool(nbg(cell).get("grade")) and not nbg(cell).get("solution")


def _passes(cell) -> bool:
    points, max_points = determine_grade(cell)
    return points is not None and points >= max_points


class _Kernel:
    """One kernel holding the solution notebook, into which bugs are swapped one at a time."""

    def __init__(self, nb, workdir: str, alt_env: dict | None = None):
        self.nb = nb
        self.alt_env = dict(alt_env or {})       # what a correct alternative's ranks run with
        # the launch-timeout scale the kernel starts with (it inherits our environment); bugs
        # and retries scale it for a while, then put it back
        self.base_scale = float(os.environ.get(TIMEOUT_SCALE_ENV) or 1)
        # nbclient writes executed cells back into the notebook it holds: give it its own copy,
        # so bugs are injected into, and cells restored from, the untouched one.
        self.client = NotebookClient(copy.deepcopy(nb), kernel_name=KERNEL_NAME, timeout=cell_timeout(),
                                     allow_errors=True, resources={"metadata": {"path": workdir}},
                                     extra_arguments=["--IPKernelApp.capture_fd_output=False"])

    def run(self, cell, i):
        cell = copy.deepcopy(cell)
        cell.outputs = []
        self.client.execute_cell(cell, i)
        return cell

    def load(self) -> list[str]:
        """Run the notebook's code cells except its tests; returns the cells that raised (a
        solution that does not load makes every bug and alternative meaningless)."""
        raised = []
        for i, cell in enumerate(self.nb.cells):
            if cell.cell_type != "code" or _is_test(cell):
                continue
            errors = [o for o in self.run(cell, i).outputs if o.get("output_type") == "error"]
            if errors:
                raised.append(f"the solution's cell {grade_id(cell) or i} raised while loading in the bank's "
                              f"kernel: {errors[0].get('ename')}: {errors[0].get('evalue')}")
        return raised

    def _passes_with_more_time(self, cell, i) -> bool:
        """Honest code that failed a test, once more with the grader's retry timeouts (×3, as
        ``confirm`` gives a student): the quick timeouts are short for a loaded machine, and two
        labs graded side by side on 2 cores timed a correct alternative's memory launch out twice."""
        self.set_timeout_scale(self.base_scale * RETRY_TIMEOUT_SCALE)
        try:
            return _passes(self.run(cell, i))
        finally:
            self.set_timeout_scale(self.base_scale)

    def check(self, name, entry, inject, index) -> tuple[list[str], float]:
        """A bug (the first test of ``catches`` must fail) or a correct alternative (the tests of
        ``must_pass`` must pass): returns the tests that did otherwise, and the seconds taken.
        A bug is run against the first test it names only: that it is caught is the point here,
        and the full selftest grades it on every test it names (most bugs name several, and a
        deadlock waits out its timeout in each)."""
        start = time.perf_counter()
        changed = inject(entry, {name: self.nb})[name]
        i = index[entry["cell"]]
        should_pass = "must_pass" in entry
        if should_pass and self.alt_env:
            self.set_env(self.alt_env)
        self.run(changed.cells[i], i)
        tests = entry["must_pass"] if should_pass else entry["catches"][:1]
        if not should_pass:
            self.set_timeout_scale(self.base_scale * BUG_TIMEOUT_SCALE)
        wrong = [t for t in tests if _passes(self.run(self.nb.cells[index[t]], index[t])) != should_pass]
        if wrong and should_pass:     # honest code, maybe slowed by a loaded machine
            wrong = [t for t in wrong if not self._passes_with_more_time(self.nb.cells[index[t]], index[t])]
        if not should_pass:
            self.set_timeout_scale(self.base_scale)
        if should_pass and self.alt_env:
            self.set_env({k: None for k in self.alt_env})
        self.run(self.nb.cells[i], i)     # the correct cell again, for the next entry
        return wrong, time.perf_counter() - start

    def set_env(self, env: dict):
        """Set (None: remove) variables of the kernel's environment, which the ranks it launches inherit."""
        code = "import os\n" + "".join(f"os.environ[{k!r}] = {v!r}\n" if v is not None else
                                       f"os.environ.pop({k!r}, None)\n" for k, v in env.items())
        self.run(nbformat.v4.new_code_cell(code), 0)

    def set_timeout_scale(self, scale: float):
        """Scale the launch timeouts of the cells run next in this kernel (``MINIDIST_TIMEOUT_SCALE``)."""
        self.run(nbformat.v4.new_code_cell(f"import os; os.environ['MINIDIST_TIMEOUT_SCALE'] = '{scale:g}'"), 0)

    def check_release(self, entry, index) -> tuple[list[str], float]:
        """The release: its stub in every solution cell (``entry["release_cells"]``, grade_id ->
        source); every test must lose its points (those of ``entry["may_pass"]`` may keep them),
        and none by running into a timeout. Returns what went otherwise, and the seconds taken."""
        start = time.perf_counter()
        stubs = entry["release_cells"]
        for gid, source in stubs.items():
            self.run(nbformat.v4.new_code_cell(source, metadata=self.nb.cells[index[gid]].metadata), index[gid])
        wrong = []
        for i, cell in enumerate(self.nb.cells):
            if cell.cell_type != "code" or not _is_test(cell):
                continue
            done = self.run(cell, i)
            if grade_id(cell) not in entry["may_pass"] and (determine_grade(done)[0] or 0) > 0:
                wrong.append(f"{grade_id(cell)} scored points")
            if "timed out" in str([o.get("evalue", "") + str(o.get("text", "")) for o in done.outputs]):
                wrong.append(f"{grade_id(cell)} timed out")
        for gid in stubs:                 # the solution again, for the next entry
            self.run(self.nb.cells[index[gid]], index[gid])
        return wrong, time.perf_counter() - start


def check_bugs(name: str, nb, bugs: list[dict], inject, workdir: str, baseline_done: threading.Event | None = None,
               meta_env: dict | None = None) -> tuple[list[str], dict[str, tuple[list[str], float]]]:
    """Run ``nb``'s code cells once (not its tests: the selftest grades the solution), then each
    bug or alternative (:meth:`_Kernel.check`). Returns (the cells that raised while loading:
    then nothing else ran, {name: (tests
    that did not fail / pass as they should, seconds)}). ``baseline_done`` is set once the first
    kernel has loaded the notebook. ``meta_env``: variables a correct alternative runs with (the
    selftest's device discipline; bugs never)."""
    kernel_argv()   # installs the pinned kernel if it is missing
    nb = skip_demos(copy.deepcopy(nb))
    index = {grade_id(c): i for i, c in enumerate(nb.cells) if grade_id(c)}
    env = {**os.environ, "NBGRADER_EXECUTION": "autograde", CHECK_TIMEOUT_ENV: QUICK_CHECK_TIMEOUT}
    shares = [bugs[k::KERNELS] for k in range(KERNELS)]
    baseline_done, baseline = baseline_done or threading.Event(), []
    results: dict[str, tuple[list[str], float]] = {}

    def kernel(k: int):
        if k and not shares[k]:
            return
        state = _Kernel(nb, workdir, meta_env)
        with state.client.setup_kernel(env=env):
            # No heartbeat thread: nbclient tells a dead kernel by its process, and jupyter_client's
            # heartbeat, once it has missed a beat on a loaded machine, reopens its socket and can
            # block for ever in a ping to the kernel being shut down, hanging the cleanup (seen
            # once: a quick selftest idle for 9 minutes in HBChannel.stop). Stopped while the
            # kernel still answers, it ends at once.
            state.client.kc.hb_channel.stop()
            if k == 0:
                try:
                    baseline.extend(state.load())
                finally:
                    baseline_done.set()
            else:
                state.load()
                baseline_done.wait()
            if baseline:
                return
            for bug in shares[k]:
                results[bug["name"]] = (state.check_release(bug, index) if "release_cells" in bug
                                        else state.check(name, bug, inject, index))

    try:
        with ThreadPoolExecutor(KERNELS) as pool:
            for f in [pool.submit(kernel, k) for k in range(KERNELS)]:
                f.result()
    finally:
        baseline_done.set()     # also when kernel 0 could not start: nobody may wait forever
    return baseline, ({} if baseline else results)
