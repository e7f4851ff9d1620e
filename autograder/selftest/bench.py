"""``python -m autograder bench``: how long grading takes on this machine.

1. one solution submission of a lab, graded in each security mode, the modes taking turns
   ``--repeat`` times (a shared machine's load drifts; the median is reported): with the
   confirmation run and the sandbox (what ``grade`` does), with the sandbox only, and with
   neither; the overhead of confirmation + sandbox is the first over the last (target <= 30 %);
2. ``-n`` copies of it with each ``--jobs`` value (target: --jobs 2 faster than --jobs 1);
   ``-n 0`` skips this part.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from autograder.course.cells import read_nb, solution_submission, write_nb
from autograder.course.labs import all_labs
from autograder.course.template import build_course

#: (label, confirm, sandbox) as ``grade`` takes them; sandbox None = where possible
MODES = [("confirm+sandbox", True, None), ("sandbox only", False, None), ("neither", False, False)]


def bench(lab: str | None = None, n: int = 8, jobs=(1, 2), repeat: int = 1, stream=None) -> list[dict]:
    from autograder.grading.grade import grade

    labs = all_labs()
    lab = lab or (labs[0] if labs else None)
    if lab is None:
        raise SystemExit("bench: no labs under solutions/")
    rows = []
    with tempfile.TemporaryDirectory(prefix="minidist-bench-") as tmp:
        tmp = Path(tmp)
        course = build_course([lab], tmp / "course")
        names = sorted(p.stem for p in (course / "source" / lab).glob("*.ipynb"))
        sub = {nm: solution_submission(read_nb(course / "source" / lab / f"{nm}.ipynb"),
                                       read_nb(course / "release" / lab / f"{nm}.ipynb"))
               for nm in names}

        def make(k):
            d = tmp / f"subs{k}"
            for i in range(k):
                for nm, nb in sub.items():
                    write_nb(nb, d / f"student{i:02d}" / lab / f"{nm}.ipynb")
            return d

        def run(d, j, label, mode="confirm+sandbox", confirm=True, sandbox=None):
            t0 = time.time()
            r = grade(d, tmp / f"out-{label}", jobs=j, labs=[lab], progress=False, confirm=confirm,
                      sandbox=sandbox)
            wall = time.time() - t0
            per = [x.seconds for x in r["jobs"]]
            full = all(float(c["points"]) >= c["max_points"] for c in r["rows"])
            row = {"lab": lab, "mode": mode, "submissions": len(per), "jobs": j, "wall_s": round(wall, 1),
                   "s_per_submission": round(sum(per) / len(per), 1),
                   "throughput_s": round(wall / len(per), 1), "all_full_marks": full,
                   "load_avg_1m": round(os.getloadavg()[0], 1), "sandbox": r["meta"]["sandbox"]}
            rows.append(row)
            print(json.dumps(row), file=stream, flush=True)
            return row

        one = make(1)
        per_mode: dict[str, list[float]] = {m: [] for m, _, _ in MODES}
        for k in range(repeat):
            for mode, confirm, sandbox in MODES:
                per_mode[mode].append(run(one, 1, f"single-{k}-{mode}", mode, confirm, sandbox)["s_per_submission"])
        dn = make(n) if n > 0 else None
        for j in (jobs if dn else ()):
            run(dn, j, f"jobs{j}")
    cols = ["lab", "mode", "submissions", "jobs", "wall_s", "s_per_submission", "throughput_s",
            "all_full_marks", "load_avg_1m"]
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols), file=stream)
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in cols), file=stream)
    print(f"sandbox: {rows[0]['sandbox']}", file=stream)
    med = {m: statistics.median(v) for m, v in per_mode.items()}
    low = {m: min(v) for m, v in per_mode.items()}
    for mode, _, _ in MODES:
        print(f"one {lab} submission, {mode}: median {med[mode]:.1f} s, best {low[mode]:.1f} s "
              f"(of {repeat})", file=stream)
    over = med["confirm+sandbox"] / med["neither"] - 1 if med["neither"] else float("nan")
    best = low["confirm+sandbox"] / low["neither"] - 1 if low["neither"] else float("nan")
    print(f"confirmation + sandbox add {100 * over:.0f} % per submission (medians; {100 * best:.0f} % "
          f"between the best runs) ({'within' if over <= 0.30 else 'OVER'} the 30 % target)", file=stream)
    scaled = [r for r in rows if r["submissions"] > 1]
    base = next((r for r in scaled if r["jobs"] == 1), None)
    for r in scaled:
        if base and r is not base:
            print(f"--jobs {r['jobs']} vs --jobs 1 on {r['submissions']} submissions: "
                  f"{base['wall_s'] / r['wall_s']:.2f}x faster", file=stream)
    print(f"one {lab} submission: {med['confirm+sandbox']:.1f} s "
          f"({'within' if med['confirm+sandbox'] <= 60 else 'OVER'} the 60 s target)", file=stream)
    return rows
