"""python -m autograder {release,student-dist,grade,similarity,feedback,export,selftest,bench,new-exercise,doctor,gradescope,prairielearn,resources} ..."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _table(rows: list[dict], cols: list[str]) -> str:
    w = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(w[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def cmd_release(a) -> int:
    from autograder.handout import release
    if a.check:
        problems = release.check()
        for p in problems:
            print(p)
        if problems:
            print("labs/ is out of date: run `python -m autograder release`", file=sys.stderr)
            return 1
        print("labs/ matches a fresh release")
        return 0
    done = release.release(a.labs or None)
    print("released:", ", ".join(done) if done else "(no labs under solutions/)")
    return 0


def _due(values) -> dict:
    out = {}
    for v in values or []:
        lab, sep, date = v.partition("=")
        if sep and not lab[:1].isdigit():
            out[lab.strip()] = date.strip()
        else:
            out["*"] = v.strip()
    return out


def cmd_grade(a) -> int:
    from autograder.grading.grade import grade
    r = grade(a.submissions, a.out, jobs=a.jobs, labs=a.lab, cell_timeout_s=a.cell_timeout,
              wall_s=a.wall_timeout, progress=not a.quiet, keep_work=a.keep_work, confirm=a.confirm,
              sandbox=a.sandbox, students=a.student, due=_due(a.due), gpus_per_job=a.gpus_per_job,
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
    print(_table(subs, ["student", "lab", "score", "seconds", "problem"]))
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


def cmd_similarity(a) -> int:
    from autograder.reports.similarity import NEAR_MISS, THRESHOLD
    from autograder.reports.similarity_report import pair_name, report
    r = report(Path(a.out), NEAR_MISS if a.near_miss is None else a.near_miss)
    top = [{"highest": f"{p.score:.2f}", "pair": pair_name(p)[:60],
            "cells": ", ".join(f"{m.a.cell} {m.score:.2f}" for m in p.matches[:4])
                     + (f", +{len(p.matches) - 4}" if len(p.matches) > 4 else ""),
            "": "flagged" if p.flagged else "near miss, not flagged"} for p in r["pairs"][:20]]
    if top:
        print(_table(top, ["highest", "pair", "cells", ""]))
        if len(r["pairs"]) > len(top):
            print(f"... and {len(r['pairs']) - len(top)} more")
    flagged = sum(p.flagged for p in r["pairs"])
    print(f"\n{r['answers']} answers compared; pairs flagged (a cell at or above {THRESHOLD:g}): {flagged}; "
          f"near misses from {r['near_miss']:g}, not flagged: {len(r['pairs']) - flagged} "
          f"(flags for a person to read; no score changed)\n"
          f"report:  {r['html']}\nresults: {Path(a.out) / 'results.csv'} ({r['rows_flagged']} rows with a similarity)")
    return 0


def cmd_feedback(a) -> int:
    from autograder.reports.feedback import collect
    made, leaks = collect(Path(a.out), Path(a.to) if a.to else None)
    for p in made:
        print(p)
    for l in leaks:
        print("LEAK:", l, file=sys.stderr)
    return 1 if leaks else 0


def cmd_export(a) -> int:
    from autograder.reports.export import canvas_columns, export
    columns = canvas_columns(a.canvas_column, a.canvas_columns)
    if columns and a.format != "canvas":
        raise SystemExit(f"--canvas-column and --canvas-columns are for --format canvas, not {a.format}")
    if a.roster and a.format == "csv":
        raise SystemExit("--roster is for --format canvas or moodle (csv is nbgrader's own export)")
    if a.moodle_percent and a.format != "moodle":
        raise SystemExit(f"--moodle-percent is for --format moodle, not {a.format}")
    print(export(Path(a.out), a.format, Path(a.to) if a.to else None, a.canvas_id, roster=a.roster,
                 columns=columns, moodle_percent=a.moodle_percent))
    return 0


def _bundle_check(a) -> int:
    from autograder.handout.platforms.version import check
    ok, text = check(a.lab, Path(a.check))
    print(text)
    return 0 if ok else 1


def cmd_gradescope(a) -> int:
    from autograder.handout.platforms.gradescope import build
    if a.check:
        return _bundle_check(a)
    dest = build(a.lab, Path(a.out), a.hidden_visibility, a.visible_visibility, a.wall_timeout, a.timeout)
    print(f"{dest}: upload it as the assignment's autograder (Gradescope: Configure Autograder, Zip file upload)")
    return 0


def cmd_prairielearn(a) -> int:
    from autograder.handout.platforms.prairielearn import build
    if a.check:
        return _bundle_check(a)
    dest = build(a.lab, Path(a.out), a.image, a.timeout)
    print(f"{dest}/questions: copy into the course repository's questions/; "
          f"{dest}/grader-image: build it (docker build -t IMAGE .), push it, name it in info.json")
    return 0


def cmd_selftest(a) -> int:
    from autograder.selftest.selftest import selftest
    ok = selftest(labs=a.lab, jobs=a.jobs, out=Path(a.out) if a.out else None,
                  cell_timeout_s=a.cell_timeout, wall_s=a.wall_timeout, progress=not a.quiet, quick=a.quick,
                  gpus_per_job=a.gpus_per_job)
    return 0 if ok else 1


def cmd_bench(a) -> int:
    from autograder.selftest.bench import bench
    bench(lab=a.lab, n=a.n, jobs=a.jobs, repeat=a.repeat)
    return 0


def cmd_resources(a) -> int:
    from autograder.handout.platforms.resources import main as measure
    rows = measure(a.lab, a.cpu)
    return 0 if all(r["ok"] for r in rows) else 1


def cmd_new_exercise(a) -> int:
    from autograder.handout.scaffold import new_exercise
    written = new_exercise(a.lab, a.name, args=a.args, points=a.points, where=a.where, after=a.after)
    print(f"exercise {a.name!r} added to {a.lab}; fill in (docs/AUTHORING.md):")
    for path in written:
        print(f"  {path}")
    return 0


def cmd_student_dist(a) -> int:
    from autograder.handout.student_dist import build
    try:
        built = build(Path(a.out))
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{a.out}: {len(built['labs'])} labs, {built['wheel'].relative_to(Path(a.out).resolve())}, README.md "
          f"(no solutions, no bug bank, no hidden cases): hand this folder to students")
    return 0


def cmd_doctor(a) -> int:
    from autograder import REPO
    from autograder.sandbox.probe import JobsCannotReach, probe
    try:
        backend, what = probe(hidden=[str(REPO / "solutions"), str(REPO / "autograder")])
    except JobsCannotReach as err:
        print(err)
        return 1
    who = "root (each job drops to its own unprivileged uid)" if os.geteuid() == 0 else f"uid {os.getuid()}"
    print(f"grader: {who}")
    print(f"sandbox: {what}" if backend else f"sandbox: NONE: {what}")
    return 0 if backend else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder", description=__doc__)
    p.add_argument("--solutions", help="course source directory (default: solutions/; "
                                       "also $MINIDIST_SOLUTIONS)")
    p.add_argument("--labs-dir", help="release directory (default: labs/)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("release", help="regenerate labs/ from solutions/ (nbgrader generate_assignment)")
    s.add_argument("labs", nargs="*", help="labs to release (default: all)")
    s.add_argument("--check", action="store_true", help="only check that labs/ is up to date")
    s.set_defaults(fn=cmd_release)

    def timing(s):
        s.add_argument("--cell-timeout", type=int, default=None,
                       help="seconds per cell (default: Execute.timeout in nbgrader_config.py)")
        s.add_argument("--wall-timeout", type=float, default=None,
                       help="wall-clock seconds per submission (default: 600)")
        s.add_argument("--quiet", action="store_true", help="no progress bar")

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
    timing(s)
    s.set_defaults(fn=cmd_grade)

    s = sub.add_parser("similarity", help="after grade: compare every answer cell of OUT with all of the installed "
                                          "minidist (its checks included) and with classmates', by pair "
                                          "(OUT/similarity.html, results.csv's similarity)")
    s.add_argument("out")
    s.add_argument("--near-miss", type=float, default=None, metavar="SCORE",
                   help="list the pairs from SCORE up to the threshold (0.8) below the flagged ones, not flagged "
                        "(default 0.6)")
    s.set_defaults(fn=cmd_similarity)

    s = sub.add_parser("feedback", help="check a graded OUT/feedback for hidden-test leaks and "
                                        "copy it to --to DIR/<student>/<lab>/ for handing back")
    s.add_argument("out")
    s.add_argument("--to")
    s.set_defaults(fn=cmd_feedback)

    s = sub.add_parser("export", help="the grades of OUT/gradebook.db as a file an LMS imports (csv: nbgrader's "
                                      "CSV, OUT/grades.csv; canvas, moodle: OUT/grades-FORMAT.csv)")
    s.add_argument("out")
    s.add_argument("--to")
    s.add_argument("--format", choices=("csv", "canvas", "moodle"), default="csv")
    s.add_argument("--canvas-id", choices=("sis_login", "sis_user"), default="sis_login",
                   help="the Canvas column that holds the student's login (default: SIS Login ID)")
    s.add_argument("--roster", metavar="CSV",
                   help="the class roster (as grade --roster's), over the one grade stored in OUT/roster.csv")
    s.add_argument("--canvas-column", action="append", metavar='LAB="NAME (ID)"',
                   help="put LAB's grades in an existing Canvas assignment's column, named as Canvas names it "
                        "(e.g. lab1=\"Lab 1 (123456)\"); repeatable")
    s.add_argument("--canvas-columns", metavar="FILE", help="the same mapping from a file, one LAB=COLUMN a line")
    s.add_argument("--moodle-percent", action="store_true",
                   help="Moodle: grades as percentages of each lab's maximum (for new grade items, whose maximum "
                        "is 100), instead of points")
    s.set_defaults(fn=cmd_export)

    vis = ("visible", "after_due_date", "after_published", "hidden")
    s = sub.add_parser("gradescope", help="LAB_autograder.zip: Gradescope's setup.sh and run_autograder grading "
                                          "with this grader")
    s.add_argument("lab")
    s.add_argument("--out", default=".")
    s.add_argument("--hidden-visibility", choices=vis, default="after_due_date",
                   help="visibility of a test cell with hidden tests (default: after_due_date)")
    s.add_argument("--visible-visibility", choices=vis, default="visible",
                   help="visibility of a test cell without hidden tests (default: visible)")
    s.add_argument("--timeout", type=float, default=600,
                   help="the assignment's Gradescope timeout, s (default 600, Gradescope's default 10 minutes)")
    s.add_argument("--wall-timeout", type=float, default=None,
                   help="a submission's wall-clock limit, s: 60 to the timeout less 60 (default: the timeout less 60)")
    s.add_argument("--check", metavar="ZIP",
                   help="build nothing: say whether the course here has changed since ZIP was built, and what")
    s.set_defaults(fn=cmd_gradescope)

    s = sub.add_parser("prairielearn", help="a PrairieLearn external-grading question for LAB and its grader image")
    s.add_argument("lab")
    s.add_argument("--out", default=".")
    s.add_argument("--image", help="required: the name the grader image is pushed under, for info.json "
                                   "(e.g. yourorg/minidist-grader-lab1)")
    s.add_argument("--timeout", type=int, default=600,
                   help="info.json's grading timeout, s: 120 to 600, PrairieLearn's maximum (default 600); "
                        "a submission's wall-clock limit is 60 s less")
    s.add_argument("--check", metavar="DIR",
                   help="build nothing: say whether the course here has changed since DIR (the output folder "
                        "or grader-image/) was built, and what")
    s.set_defaults(fn=cmd_prairielearn)

    s = sub.add_parser("selftest", help="solution = full marks, release = 0, every bank bug caught, "
                                        "every correct alternative full marks")
    s.add_argument("--lab", action="append")
    s.add_argument("--jobs", type=int, default=2)
    s.add_argument("--out", help="keep the selftest's grading output here")
    s.add_argument("--quick", action="store_true",
                   help="grade the solution with nbgrader, check the release, the bugs and the alternatives "
                        "in kernels (minutes instead of tens of minutes; what `make test` runs)")
    s.add_argument("--gpus-per-job", type=int, default=None, metavar="K", help="as grade's (GPU nodes)")
    timing(s)
    s.set_defaults(fn=cmd_selftest)

    s = sub.add_parser("bench", help="seconds per submission with confirmation + sandbox and without, "
                                     "and --jobs 1 vs 2 on N submissions")
    s.add_argument("--lab", default=None, help="default: the first lab under solutions/")
    s.add_argument("-n", type=int, default=8, help="copies graded with each --jobs value (0: skip)")
    s.add_argument("--repeat", type=int, default=1, help="grade the single submission this often per mode")
    s.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("resources", help="per lab: wall time and peak memory (process tree) of grading the solution "
                                         "as run_autograder does, pinned to one CPU")
    s.add_argument("--lab", action="append", help="default: every lab")
    s.add_argument("--cpu", type=int, default=0, help="the CPU to pin to (taskset -c; default 0)")
    s.set_defaults(fn=cmd_resources)

    s = sub.add_parser("new-exercise", help="add the skeleton of a graded exercise to LAB: its cells in the source "
                                            "notebook, its check in the lab's checks folder, stub bank entries")
    s.add_argument("lab")
    s.add_argument("name", help="the graded function's name")
    s.add_argument("--args", default="x", help="its parameters, as written in its def (default: x)")
    s.add_argument("--points", type=int, default=2, help="the test cell's points (default: 2)")
    s.add_argument("--where", choices=("here", "launch"), default="here",
                   help="where the answer is made: in the grading process, or on the ranks of a launch")
    s.add_argument("--after", help="insert after the cell of this grade_id (default: at the end)")
    s.set_defaults(fn=cmd_new_exercise)

    s = sub.add_parser("student-dist", help="OUT: what students get: the released labs, a wheel of the minidist "
                                            "library without hidden cases, a README (no solutions, no bug bank)")
    s.add_argument("out", metavar="OUT", help="the folder to write (new, empty, or an earlier distribution)")
    s.set_defaults(fn=cmd_student_dist)

    s = sub.add_parser("doctor", help="which sandbox grading would use here, and what it guarantees")
    s.set_defaults(fn=cmd_doctor)

    from autograder.course.labs import resolve_lab
    a = p.parse_args(argv)
    for flag, var in (("solutions", "MINIDIST_SOLUTIONS"), ("labs_dir", "MINIDIST_LABS")):
        if getattr(a, flag):
            os.environ[var] = str(Path(getattr(a, flag)).resolve())
    try:
        for flag in ("lab", "labs"):
            value = getattr(a, flag, None)
            if value:
                setattr(a, flag, resolve_lab(value) if isinstance(value, str) else [resolve_lab(v) for v in value])
    except ValueError as e:
        p.error(str(e))
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
