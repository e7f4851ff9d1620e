"""``python -m autograder bench``: how long grading takes on this machine.

Grades the solution of a lab once (seconds for one submission: target <= 60 s for lab 1),
then N copies of it with each --jobs value (target: --jobs 2 faster than --jobs 1).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from autograder.course import (all_labs, build_course, read_nb, solution_submission, write_nb)


def bench(lab: str | None = None, n: int = 8, jobs=(1, 2), stream=None) -> list[dict]:
    from autograder.grade import grade

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

        def run(d, j, label):
            t0 = time.time()
            r = grade(d, tmp / f"out-{label}", jobs=j, labs=[lab], progress=False)
            wall = time.time() - t0
            per = [x.seconds for x in r["jobs"]]
            full = all(float(c["points"]) >= c["max_points"] for c in r["rows"])
            row = {"lab": lab, "submissions": len(per), "jobs": j, "wall_s": round(wall, 1),
                   "s_per_submission": round(sum(per) / len(per), 1),
                   "throughput_s": round(wall / len(per), 1), "all_full_marks": full,
                   "load_avg_1m": round(os.getloadavg()[0], 1)}
            rows.append(row)
            print(json.dumps(row), file=stream, flush=True)
            return row

        run(make(1), 1, "single")
        dn = make(n)
        for j in jobs:
            run(dn, j, f"jobs{j}")
    cols = ["lab", "submissions", "jobs", "wall_s", "s_per_submission", "throughput_s",
            "all_full_marks", "load_avg_1m"]
    print("  ".join(cols), file=stream)
    for r in rows:
        print("  ".join(str(r[c]).ljust(len(c)) for c in cols), file=stream)
    base = next((r for r in rows[1:] if r["jobs"] == 1), None)
    for r in rows[1:]:
        if base and r is not base:
            print(f"--jobs {r['jobs']} vs --jobs 1 on {r['submissions']} submissions: "
                  f"{base['wall_s'] / r['wall_s']:.2f}x faster", file=stream)
    one = rows[0]
    print(f"one {lab} submission: {one['s_per_submission']} s "
          f"({'within' if one['s_per_submission'] <= 60 else 'OVER'} the 60 s target)", file=stream)
    return rows
