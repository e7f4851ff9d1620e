"""A job's box: what its sandboxes see of the grader's files, and the processes it starts in them.

The box is a folder in the batch's area (:func:`autograder.sandbox.backend.make_area`) given to the
job's uid: a private home (its matplotlib cache from the batch's skeleton, and an IPython startup file
that makes the files handed in importable by the student's code alone, :mod:`autograder.confirm.handed_in`),
the kernel's working folder (a copy of what was handed in, without the hidden tests nbgrader writes back
into its own folder), and a folder per confirmation run. From it the job starts the kernel nbgrader
drives (:attr:`Box.kernel`, in the sandbox where there is one) and its confirmation runs
(:meth:`Box.confirmation`). Where no sandbox works the job still runs as its own uid with its limits;
only a batch whose sandbox is turned off on purpose keeps the grader's (``drop``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from autograder.confirm import handed_in
from autograder.confirm.start import Confirmation, plan
from autograder.grading.worker.retry import RETRY_TIMEOUT_SCALE, scaled
from autograder.grading.worker.submission import HandedIn, JobCourse, copy_extra_files
from autograder.sandbox.backend import Backend, give, limits
from autograder.sandbox.home import inner_env, prepare_home
from autograder.sandbox.kernel import KernelJob
from minidist.protocol import HIDDEN_CASES_ENV, HIDDEN_IN_CONFIRMATION


class Box:
    """The box of one job (see the module's docstring); :meth:`remove` when the job is done."""

    def __init__(self, spec: dict, course: JobCourse, handed: HandedIn, deadline: float):
        self.spec, self.course, self.handed, self.deadline = spec, course, handed, deadline
        self.backend = Backend(**spec["sandbox"]) if spec.get("sandbox") else None
        # the job's uid and limits: in the sandbox, or alone where none works (never root); none at all only
        # when the sandbox is turned off on purpose (autograder/grading/batch.py: prepare_batch)
        drop = spec.get("drop", True)
        self.uid = spec.get("uid") if drop else None
        self.root = Path(tempfile.mkdtemp(prefix="job-", dir=spec.get("area") or None))
        home = self.root / "home"
        self.pristine = Path(spec["pristine"])
        self.skeleton = Path(spec["skeleton"]) if spec.get("skeleton") else None
        prepare_home(home, self.skeleton)
        startup = home / ".ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True, exist_ok=True)    # the kernel's handed-in files: for the student's imports only
        shutil.copyfile(handed_in.__file__, startup / "00-handed-in.py")
        # the kernel's working folder: what the student handed in, no hidden tests
        kernel_cwd = shutil.copytree(handed.dest, self.root / "kernel-cwd")
        give(self.root, self.uid)
        self.limit = limits(cpu_seconds=2 * float(spec.get("wall", 600))) if drop else None
        # a confirmed batch's kernels have no hidden cases: their hidden=True calls are the confirmation's
        self.kernel = KernelJob(self.backend, str(home), str(self.pristine), spec["tag_var"], str(kernel_cwd), self.uid,
                                spec.get("tools"), self.limit,
                                env={HIDDEN_CASES_ENV: HIDDEN_IN_CONFIRMATION} if spec.get("confirm", True) else {})
        self.conf_env = inner_env(os.environ, str(home / "confirm"), str(self.pristine), spec["tag_var"])

    def confirmation(self, name: str, only=None, retry: bool = False) -> Confirmation:
        """Start a confirmation run of notebook ``name`` (``only``: these tests; ``retry``: the second chance,
        its timeouts x :data:`~autograder.grading.worker.retry.RETRY_TIMEOUT_SCALE`)."""
        wd = self.root / "confirm" / f"{name}-{2 if retry else 1}"
        chome = prepare_home(wd, self.skeleton)
        copy_extra_files(self.handed.folder, wd, self.handed.used)    # a helper module works in both runs, or in neither
        give(wd, self.uid)
        env = dict(self.conf_env, HOME=str(chome), IPYTHONDIR=str(chome / ".ipython"), MPLCONFIGDIR=str(chome / ".mpl"),
                   JUPYTER_RUNTIME_DIR=str(chome / ".runtime"))
        scale = RETRY_TIMEOUT_SCALE if retry else 1          # what timed out under load gets more time
        return Confirmation(plan(self.course.source_nbs[name], self.handed.notebooks[name]), pristine=self.pristine,
                            workdir=wd, sandbox=self.backend, env=scaled(env, scale),
                            box={"uid": self.uid, "tools": self.spec.get("tools"), "limit": self.limit},
                            timeout=max(10.0, self.deadline - time.time()),
                            cell_timeout=self.spec["cell_timeout"] * scale,
                            log=self.course.job / f"confirm-{wd.name}.log", only=only)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
