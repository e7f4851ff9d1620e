"""``python -m autograder grade``: grade a class, each submission in isolation, in parallel.

Design (nbgrader has no parallel autograde, its issue #174):
1. once per batch: a *template* course (``nbgrader generate_assignment`` for every lab graded,
   giving source/, release/ and a gradebook, with the labs' due dates), a pristine copy of
   minidist, and a probe of the sandbox (:mod:`autograder.sandbox`):
   :func:`autograder.grading.batch.open_batch`;
2. each submission <student>/<lab>/ is graded by the grading core every platform shares
   (:func:`autograder.grading.batch.grade_submission`): a child process (:mod:`autograder.grading.worker`)
   in its own course directory with its own copy of the gradebook, in its own session, under a
   wall-clock limit; its kernel and its confirmation run (:mod:`autograder.confirm`) are
   sandboxed. A supervisor thread (:mod:`autograder.grading.supervise`) reads the child's pipe
   (progress, then the result) and checks what arrives: a malformed or missing record costs
   that submission, with a reason, never the batch; afterwards every process the child
   started is killed (:mod:`autograder.sandbox.procs`);
3. the scores are merged into one nbgrader gradebook (``OUT/gradebook.db``) through
   nbgrader's Gradebook API, and ``grades.csv`` is written by nbgrader's CSV export.

Stopped half-way (Ctrl-C, SIGTERM), the grader kills every running job within a second,
writes nothing to OUT, and exits with 128 + the signal's number.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

from autograder.course.labs import all_labs, solutions_dir
from autograder.course.template import build_course
from autograder.grading.batch import close_batch, grade_submission, merged_due_dates, open_batch
from autograder.grading.gradebook import export_csv, merge_gradebook, set_due_dates
from autograder.grading.records import Job
from autograder.grading.results import load_previous, write_feedback, write_results
from autograder.grading.roster import ROSTER_FILE, not_on_roster, read_roster, warning, write_roster
from autograder.grading.supervise import INTERRUPTED


class Progress:
    """A dependency-free progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        # sys.stderr at call time, not at import time (pytest swaps and closes it per test)
        stream = sys.stderr if stream is None else stream
        self.total, self.done, self.enabled, self.stream = total, 0, enabled, stream
        self.t0 = time.time()
        self.lock = threading.Lock()
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._draw("")

    def _draw(self, label: str):
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"grading [{bar}] {self.done}/{self.total} "
                f"{time.time() - self.t0:5.0f}s{self.eta()} {label}")
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def eta(self, now: float | None = None) -> str:
        """The batch's time left at the rate so far (submissions finished per second, parallel jobs
        included): " ETA 12m05s", or "" before the first one has finished and once all have."""
        if not self.done or self.done >= self.total:
            return ""
        left = ((now if now is not None else time.time()) - self.t0) / self.done * (self.total - self.done)
        return f" ETA {int(left // 60)}m{int(left % 60):02d}s"

    def step(self, label: str):
        with self.lock:
            self.done += 1
            self._draw(label)

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def discover(submissions: Path, labs: list[str] | None, only: list[str] | None = None
             ) -> tuple[list[tuple[str, str, Path | None]], list[str], list[str]]:
    """[(student, lab, dir or None)], the labs graded, and ignored entries (``only``: these students)."""
    known = all_labs()
    ignored = []
    students = sorted(p for p in submissions.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")))
    if only:
        missing = sorted(set(only) - {p.name for p in students})
        if missing:
            raise SystemExit(f"no submission folder for student(s) {missing} under {submissions}")
        students = [p for p in students if p.name in set(only)]
    if labs:
        unknown = [l for l in labs if l not in known]
        if unknown:
            raise SystemExit(f"unknown lab(s) {unknown}; labs under {solutions_dir()}: {known}")
        graded = list(labs)
    else:
        graded = sorted({d.name for s in students for d in s.iterdir() if d.is_dir()} & set(known))
    for s in students:
        for d in s.iterdir():
            if d.is_dir() and d.name not in graded and not d.name.startswith("."):
                ignored.append(f"{s.name}/{d.name}")
    entries = []
    for s in students:
        for lab in graded:
            d = s / lab
            entries.append((s.name, lab, d if d.is_dir() else None))
    return entries, graded, ignored


@contextmanager
def _stopped_by_signals(stop: threading.Event):
    """SIGINT / SIGTERM set ``stop`` (the supervisors then kill their jobs) instead of leaving
    the workers to finish on their own; yields the signals caught. Only the main thread can
    take signals: elsewhere (a grader run from a thread) this does nothing."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def handler(signum, frame):
        caught.append(signum)
        stop.set()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def visible_gpu_ids(env=None) -> list[str]:
    """The GPUs this grader may hand out: its own ``CUDA_VISIBLE_DEVICES`` if set (indices or
    UUIDs), else one index per ``/dev/nvidiaN`` node (CUDA's indices 0..N-1; which physical GPU
    an index names does not matter, only that two jobs never get the same one)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    nodes = [n for n in (os.listdir("/dev") if os.path.isdir("/dev") else []) if re.fullmatch(r"nvidia\d+", n)]
    return [str(i) for i in range(len(nodes))]


def gpu_slots(jobs: int, per_job: int, gpus: list[str]) -> list[str]:
    """``jobs`` disjoint ``CUDA_VISIBLE_DEVICES`` values of ``per_job`` GPUs each, from ``gpus``;
    a clear error (before anything is graded) when there are not enough."""
    if per_job < 1:
        raise SystemExit(f"--gpus-per-job must be at least 1, not {per_job}")
    if jobs * per_job > len(gpus):
        raise SystemExit(f"--gpus-per-job {per_job} with --jobs {jobs} needs {jobs * per_job} GPUs, but "
                         f"{len(gpus)} are visible ({','.join(gpus) or 'none'}): use --jobs "
                         f"{max(1, len(gpus) // per_job)} or fewer" if len(gpus) >= per_job else
                         f"--gpus-per-job {per_job} needs {per_job} GPUs, but only {len(gpus)} visible "
                         f"({','.join(gpus) or 'none'})")
    return [",".join(gpus[i * per_job:(i + 1) * per_job]) for i in range(jobs)]


def run_all(todo: list, jobs: int, env: dict, run, slots: list[str] | None = None, extra: dict | None = None):
    """Run ``run(job, env)`` for every job, ``jobs`` at a time; yields (job, future) as each ends.
    ``extra``: {student: variables} added to that student's jobs' environment (the selftest's
    ``MINIDIST_RANK_DEFAULT_DEVICE``).

    With ``slots`` (:func:`gpu_slots`), a job takes a free slot for as long as it runs: its
    environment (the worker's, hence its kernels' and its confirmation's) has that slot as
    ``CUDA_VISIBLE_DEVICES`` and ``MINIDIST_SANDBOX_GPU=1`` (the sandbox shows the GPU devices), so
    two jobs running at once never see the same GPU index."""
    free: queue.Queue = queue.Queue()
    for s in slots or []:
        free.put(s)

    def one(job):
        own = dict(env, **(extra or {}).get(job.student, {}))
        if not slots:
            return run(job, own)
        gpus = free.get()
        try:
            out = run(job, dict(own, CUDA_VISIBLE_DEVICES=gpus, MINIDIST_SANDBOX_GPU="1"))
            if isinstance(getattr(out, "result", None), dict):
                out.result["gpus"] = gpus
            return out
        finally:
            free.put(gpus)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        futs = {ex.submit(one, j): j for j in todo}
        for f in as_completed(futs):
            yield futs[f], f


def grade(submissions, out, jobs: int = 1, labs: list[str] | None = None,
          cell_timeout_s: int | None = None, wall_s: float | None = None,
          progress: bool = True, keep_work: bool = False, confirm: bool = True,
          sandbox: bool | None = None, students: list[str] | None = None,
          due: dict[str, str] | None = None, stream=None, gpus_per_job: int | None = None,
          job_env: dict[str, dict] | None = None, roster=None) -> dict:
    """Grade SUBMISSIONS into OUT. ``confirm``: confirmation runs (default on); ``sandbox``: None
    = where possible, True = required, False = off; ``students``: grade only these and merge
    into the results already in OUT; ``due``: {lab or "*": date}, over the course config;
    ``gpus_per_job``: each parallel job gets that many GPUs of its own (:func:`gpu_slots`);
    ``job_env``: {student: variables} for that student's worker, kernels and confirmation;
    ``roster``: a roster CSV (:mod:`autograder.grading.roster`), read before anything is graded and stored as
    OUT/roster.csv for ``export``."""
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if not submissions.is_dir():
        raise SystemExit(f"no such directory: {submissions}")
    stream = stream if stream is not None else sys.stderr
    people = read_roster(roster) if roster else None
    slots = gpu_slots(max(1, jobs), gpus_per_job, visible_gpu_ids()) if gpus_per_job else None
    entries, graded, ignored = discover(submissions, labs, students)
    previous = load_previous(out) if students else []
    out.mkdir(parents=True, exist_ok=True)
    work = out / "_work"
    shutil.rmtree(work, ignore_errors=True)
    if not students:
        for sub in ("feedback", "autograded"):
            shutil.rmtree(out / sub, ignore_errors=True)
    t0 = time.time()
    batch = open_batch(graded, work, out, jobs=jobs, confirm=confirm, sandbox=sandbox,
                       cell_timeout_s=cell_timeout_s, wall_s=wall_s, due=due, stream=stream)
    template = batch.template
    todo = [Job(s, lab, d, work / "jobs" / f"{s}__{lab}") for s, lab, d in entries]
    bar = Progress(len(todo), enabled=progress)
    done: list[Job] = []
    stop = threading.Event()
    with _stopped_by_signals(stop) as caught:
        run = lambda j, e: grade_submission(batch, j, e, stop)      # noqa: E731
        for j, f in run_all(todo, jobs, batch.env, run, slots, job_env):
            done.append(f.result())           # grade_submission never raises for a submission's sake
            bar.step(f"{j.student}/{j.lab}")
    bar.close()
    close_batch(batch)
    if caught:
        shutil.rmtree(work, ignore_errors=True)
        name = signal.Signals(caught[0]).name
        print(f"autograder: {name}: grading interrupted; every process of the batch was stopped, "
              f"{sum(j.result.get('failure') != INTERRUPTED for j in done)} of {len(todo)} submissions had "
              f"finished, and nothing was written to {out}", file=stream)
        raise SystemExit(128 + caught[0])
    regraded = {(j.student, j.lab) for j in done}
    everyone = done + [j for j in previous if (j.student, j.lab) not in regraded]
    meta = {"labs": graded, "jobs": jobs, "cell_timeout_s": batch.cell_timeout, "wall_clock_limit_s": batch.wall,
            "ignored": ignored, "seconds": None, "sandbox": batch.sandbox, "confirmation": bool(confirm),
            "due_dates": batch.dues,
            "gpus_per_job": gpus_per_job, "gpu_slots": slots,
            "regraded": sorted({j.student for j in done}) if students else None}
    if template is not None:
        all_labs_graded = sorted({j.lab for j in everyone})
        if set(all_labs_graded) - set(graded):      # an earlier run graded more labs: a template for all
            template = build_course(all_labs_graded, work / "template-all")
            set_due_dates(template, {l: d for l, d in merged_due_dates(graded, due).items() if l in all_labs_graded and d})
        db = merge_gradebook(template, out, everyone)
        export_csv(db, out / "grades.csv")
    for j in done:
        write_feedback(out, j)
    if people is not None:
        write_roster(people, out / ROSTER_FILE)
        missing = not_on_roster(people, {j.student for j in everyone})
        if missing:
            print(warning(str(roster), missing), file=stream)
    meta["seconds"] = round(time.time() - t0, 2)
    rows = write_results(out, everyone, meta)
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return {"jobs": done, "rows": rows, "meta": meta, "out": out, "all_jobs": everyone}
