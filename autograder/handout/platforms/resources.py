"""``python -m autograder resources [--lab LAB ...] [--cpu 0]``: what grading one submission takes on
one CPU, per lab, to size a platform's container (Gradescope's default: 10 minutes, ½ vCPU, 768 MB).

Per lab, the solution (as a student hands it in) is graded by the program ``run_autograder`` runs
(``python -m autograder.handout.platforms.gradescope LAB``, confirmation and sandbox as in a real run), pinned
to CPU ``--cpu`` with ``taskset -c``, into a temporary Gradescope root. Measured: the wall time, and
the peak memory of the whole process tree, sampled every 0.2 s as the sum over every process below
the grader (its workers, kernels, confirmation, judge and ranks, in their sandboxes too) of its
proportional set size (``Pss`` in ``/proc/PID/smaps_rollup``: a page shared by n processes counts
1/n in each, so torch's libraries mapped by every rank count once; RSS where Pss cannot be read). A
process that leaves the tree (reparented to init) is not counted. The score is checked (full
marks, else the row says so). Run it on a quiet machine: the numbers are per machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _memory(pid: int) -> int:
    """Bytes: the process's Pss, or its RSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def tree_memory(root: int) -> int:
    kids, todo, total = _children(), [root], 0
    while todo:
        pid = todo.pop()
        total += _memory(pid)
        todo += kids.get(pid, [])
    return total


def measure(lab: str, cpu: int = 0) -> dict:
    """Grade ``lab``'s solution as ``run_autograder`` does, on CPU ``cpu``: wall s, peak MiB, score."""
    from autograder.course.cells import read_nb, solution_submission, write_nb
    from autograder.course.template import build_course
    work = Path(tempfile.mkdtemp(prefix="minidist-resources-"))
    try:
        course = build_course([lab], work / "course")
        root = work / "gradescope"
        for name in sorted(p.stem for p in (course / "source" / lab).glob("*.ipynb")):
            src, rel = (read_nb(course / d / lab / f"{name}.ipynb") for d in ("source", "release"))
            write_nb(solution_submission(src, rel), root / "submission" / f"{name}.ipynb")
        (root / "results").mkdir(parents=True)
        argv = ["taskset", "-c", str(cpu), sys.executable, "-m", "autograder.handout.platforms.gradescope", lab,
                "--root", str(root)]
        peak, done = 0, threading.Event()
        t0 = time.time()
        log = open(work / "grader.log", "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

        def sample():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tree_memory(proc.pid))
                done.wait(0.2)
        t = threading.Thread(target=sample, daemon=True)
        t.start()
        proc.wait()
        wall = time.time() - t0
        done.set()
        t.join()
        log.close()
        if proc.returncode != 0:         # the grader's own failure: it says why on its output
            raise SystemExit(f"{lab}: the grader failed (exit {proc.returncode}):\n"
                             + (work / "grader.log").read_text()[-3000:])
        data = json.loads((root / "results" / "results.json").read_text())
        full = sum(x.get("max_score", 0) for x in data["tests"])
        return {"lab": lab, "wall_s": round(wall, 1), "peak_mib": round(peak / 2**20), "score": data["score"],
                "max_score": full, "ok": data["score"] == full,
                "sandbox": "none" if "sandbox: none" in data["output"] else "yes"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(labs: list[str] | None = None, cpu: int = 0, stream=None) -> list[dict]:
    from autograder.course.labs import all_labs
    stream = stream or sys.stdout
    if not shutil.which("taskset"):
        raise SystemExit("taskset (util-linux) is needed to pin grading to one CPU")
    rows = []
    print(f"| lab | wall s on CPU {cpu} | peak memory MiB (process tree, Pss) | score | sandbox |", file=stream)
    print("| --- | --- | --- | --- | --- |", file=stream)
    for lab in labs or all_labs():
        r = measure(lab, cpu)
        rows.append(r)
        print(f"| {lab} | {r['wall_s']} | {r['peak_mib']} | {r['score']:g}/{r['max_score']:g}"
              f"{'' if r['ok'] else ' NOT FULL MARKS'} | {r['sandbox']} |", file=stream, flush=True)
    return rows
