"""``python -m autograder bench --class N``: a class's grading as an instructor meets it.

N copies of a lab's solution are graded by ``python -m autograder grade --jobs J``, with the
confirmation and without it (``--no-confirm``), the two taking turns ``--repeat`` times (a shared
machine's load drifts; medians are reported). For each run: submissions per hour (N over the wall
time) and CPU-seconds per submission: the user and system time of every process the grading started,
kernels, ranks and sandboxes included, read from this process's children's usage. This process makes
itself the *subreaper* of everything below it (``PR_SET_CHILD_SUBREAPER``), so a process orphaned on
the way (a kernel started in a session of its own) is reaped here and counted, not lost to the
machine's init. CPU time is far less sensitive to other users' load than wall time; the load average
is printed next to every run all the same.
"""
from __future__ import annotations

import csv
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _reap(grace: float = 10.0) -> None:
    """Reap every orphan left to this process (a sandbox dies a moment after its job)."""
    deadline = time.time() + grace
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.time() > deadline:
                return
            time.sleep(0.05)


def graded_once(subs: Path, out: Path, lab: str, jobs: int, confirm: bool, n: int) -> dict:
    """One ``grade`` of the ``n`` submissions in ``subs``: its wall time, CPU time, and whether every test
    got full marks."""
    argv = [sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--lab", lab,
            "--jobs", str(jobs), "--quiet"] + ([] if confirm else ["--no-confirm"])
    cpu0, t0 = _children_cpu(), time.time()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    _reap()
    cpu = _children_cpu() - cpu0
    full = False
    try:
        with open(out / "results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        full = bool(rows) and all(float(r["points"] or 0) >= float(r["max_points"]) for r in rows)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if proc.returncode != 0:
        print(proc.stdout[-3000:], file=sys.stderr)
    return {"lab": lab, "confirm": confirm, "submissions": n, "jobs": jobs, "wall_s": round(wall, 1),
            "per_hour": round(3600 * n / wall), "cpu_s_per_submission": round(cpu / n, 2),
            "all_full_marks": full, "rc": proc.returncode, "load_avg_1m": round(os.getloadavg()[0], 1)}


def class_bench(lab: str, n: int, jobs=(1,), repeat: int = 3, stream=None) -> list[dict]:
    """Grade ``n`` copies of ``lab``'s solution with each ``--jobs`` value, with and without the
    confirmation, ``repeat`` times each; print every run and the medians."""
    from autograder.course.cells import read_nb, solution_submission, write_nb
    from autograder.course.template import build_course

    if n < 1 or repeat < 1:
        raise SystemExit("bench --class: N and --repeat must be at least 1")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="minidist-class-") as tmp:
        tmp = Path(tmp)
        course = build_course([lab], tmp / "course")
        for source in sorted((course / "source" / lab).glob("*.ipynb")):
            nb = solution_submission(read_nb(source), read_nb(course / "release" / lab / source.name))
            for i in range(n):
                write_nb(nb, tmp / "subs" / f"student{i:03d}" / lab / source.name)
        for j in jobs:
            for k in range(repeat):
                for confirm in (True, False):
                    row = graded_once(tmp / "subs", tmp / f"out-{j}-{k}-{int(confirm)}", lab, j, confirm, n)
                    rows.append(row)
                    print(json.dumps(row), file=stream, flush=True)
    print(f"{lab}, a class of {n}, medians of {repeat} (machine: {os.cpu_count()} CPUs; the load average "
          f"is the machine's, other users' work included):", file=stream)
    for j in jobs:
        med = {c: {key: statistics.median(r[key] for r in rows if r["jobs"] == j and r["confirm"] == c)
                   for key in ("per_hour", "cpu_s_per_submission", "wall_s")} for c in (True, False)}
        cpu_over = med[True]["cpu_s_per_submission"] / med[False]["cpu_s_per_submission"] - 1
        wall_over = med[True]["wall_s"] / med[False]["wall_s"] - 1
        for c in (True, False):
            print(f"  --jobs {j}, {'with' if c else 'without'} the confirmation: {med[c]['per_hour']:.0f} "
                  f"submissions per hour, {med[c]['cpu_s_per_submission']:.2f} CPU-s per submission", file=stream)
        print(f"  the confirmation adds {100 * cpu_over:.0f} % of CPU time and {100 * wall_over:.0f} % of wall "
              f"time ({'within' if cpu_over <= 0.30 else 'OVER'} the 30 % target)", file=stream)
    if not all(r["all_full_marks"] for r in rows):
        print("  WARNING: some run did not give the solution full marks", file=stream)
    return rows
