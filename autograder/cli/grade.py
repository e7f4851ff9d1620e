"""``python -m autograder grade SUBMISSIONS --out DIR``: a class graded, one line per submission."""
from __future__ import annotations

from autograder.cli.common import add_timing, table


def add(sub) -> None:
    s = sub.add_parser("grade", help="grade SUBMISSIONS/<student>/<lab>/<notebook>.ipynb")
    s.add_argument("submissions")
    s.add_argument("--out", required=True)
    s.add_argument("--jobs", type=int, default=1)
    s.add_argument("--lab", action="append", help="grade only this lab (repeatable)")
    s.add_argument("--keep-work", action="store_true", help="keep OUT/_work (per-job course dirs)")
    s.add_argument("--student", nargs="+", metavar="ID",
                   help="re-grade only these students and merge into the results already in --out")
    s.add_argument("--due", action="append", metavar="[LAB=]DATE",
                   help="due date (ISO 8601 with time zone) of LAB, or of every lab graded; over the course "
                        "config (c.Minidist.due_dates); late penalties follow c.LatePenalty")
    s.add_argument("--roster", metavar="CSV",
                   help="the class roster (columns login, name, email, lms_id, section; login required): "
                        "checked before grading, stored as OUT/roster.csv for export's Canvas and Moodle files")
    s.add_argument("--no-confirm", dest="confirm", action="store_false",
                   help="skip the confirmation run (tests again outside the kernel); for measurements only")
    s.add_argument("--gpus-per-job", type=int, default=None, metavar="K",
                   help="give each parallel job K GPUs of its own (CUDA_VISIBLE_DEVICES; the sandbox shows the GPU "
                        "devices); --jobs times K must not exceed the GPUs visible")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--sandbox", dest="sandbox", action="store_const", const=True, default=None,
                   help="require a sandbox (fail if none is possible); default: use one where possible")
    g.add_argument("--no-sandbox", dest="sandbox", action="store_const", const=False,
                   help="run kernels unsandboxed (for measurements only)")
    add_timing(s)
    s.set_defaults(fn=run)


def due(values) -> dict:
    """{lab or "*": date} from ``--due`` values (``LAB=DATE``, or a date for every lab)."""
    out = {}
    for v in values or []:
        lab, sep, date = v.partition("=")
        if sep and not lab[:1].isdigit():
            out[lab.strip()] = date.strip()
        else:
            out["*"] = v.strip()
    return out


def run(a) -> int:
    from autograder.grading.grade import grade
    r = grade(a.submissions, a.out, jobs=a.jobs, labs=a.lab, cell_timeout_s=a.cell_timeout,
              wall_s=a.wall_timeout, progress=not a.quiet, keep_work=a.keep_work, confirm=a.confirm,
              sandbox=a.sandbox, students=a.student, due=due(a.due), gpus_per_job=a.gpus_per_job,
              roster=a.roster)
    subs = []
    for j in sorted(r["jobs"], key=lambda j: (j.student, j.lab)):
        cells = [c for nb in j.result["cells"].values() for c in nb.values()]
        manual = sum(c["max_points"] for c in cells if c["status"] == "manual")
        subs.append({"student": j.student, "lab": j.lab,
                     "score": f"{sum(float(c['points'] or 0) for c in cells):g}/"
                              f"{sum(c['max_points'] for c in cells):g}"
                              + (f" ({manual:g} await manual grading)" if manual else ""),
                     "seconds": f"{j.seconds:.1f}",
                     "problem": (j.result.get("failure") or "; ".join(j.result.get("notes", [])))[:80]})
    print(table(subs, ["student", "lab", "score", "seconds", "problem"]))
    out = r["out"]
    print(f"\n{len(subs)} submissions in {r['meta']['seconds']:.1f} s with --jobs {a.jobs}"
          f" (sandbox: {r['meta']['sandbox']}; confirmation {'on' if r['meta']['confirmation'] else 'OFF'})")
    if a.student:
        print(f"re-graded {', '.join(r['meta']['regraded'])}; merged with the {len(r['all_jobs'])} results in {r['out']}")
    print(f"grades:   {out / 'grades.csv'}\nresults:  {out / 'results.csv'}, {out / 'results.json'}\n"
          f"batch:    {out / 'batch.json'} (the sandbox, confirmation, limits and due dates of every row)\n"
          f"feedback: {out / 'feedback'}/<student>/<lab>/<notebook>.html\n"
          + (f"roster:   {out / 'roster.csv'} (export's Canvas and Moodle files read it)\n" if a.roster else "")
          + f"next:     python -m autograder similarity {out}   (answers that look copied, for you to read)")
    return 0
