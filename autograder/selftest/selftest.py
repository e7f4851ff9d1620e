"""``python -m autograder selftest``: the grader and the tests of every lab, checked.

For each lab, grades in one batch: the solution (must get full marks), the untouched
release (0 on every implementation test, no timeout), and every bug of the lab's bug
bank injected into a copy of the solution (must lose points on each test it names).
"""
from __future__ import annotations

import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from minidist.protocol import RANK_DEFAULT_DEVICE_ENV
from autograder.course.cells import grade_id, nbg, read_nb, solution_submission, write_nb
from autograder.course.labs import all_labs, bank_file, lab_notebooks
from autograder.course.template import build_course
from autograder.selftest.bank import BankError, alternative_tests, check_bank, inject, load_bank


#: torch's default device inside every rank (minidist/runtime/rank_process.py's DEFAULT_DEVICE_ENV)
DEFAULT_DEVICE_ENV = RANK_DEFAULT_DEVICE_ENV
#: what the solution and the correct alternatives of a lab marked for device discipline run with:
#: anything a rank makes without ``device=`` lands on ``meta`` and fails, as it would on a GPU rank
META = {DEFAULT_DEVICE_ENV: "meta"}


def device_discipline(source_nbs: dict) -> bool:
    """Whether the lab's solution notebooks say ``metadata["minidist"]["device_discipline"] = True``
    (issue 26): then its solution and correct alternatives run with :data:`META`; bugs never do."""
    return bool(source_nbs) and all((nb.metadata.get("minidist") or {}).get("device_discipline") is True
                                    for nb in source_nbs.values())


def manual_points(rows: dict) -> tuple[float, list[str]]:
    """Points of a submission's cells that await manual grading (a written answer), and those cells."""
    cells = [c for c, row in rows.items() if row["status"] == "manual"]
    return sum(float(rows[c]["max_points"]) for c in cells), cells


def selftest(labs=None, jobs: int = 2, out: Path | None = None, cell_timeout_s=None, wall_s=None,
             progress: bool = True, stream=None, quick: bool = False, gpus_per_job: int | None = None) -> bool:
    """Grade solution, release and every bug and alternative of each lab. ``quick``: the solution
    goes through nbgrader as usual; the release, the bugs and the alternatives through
    :mod:`autograder.selftest.bugcheck` (the bank's kernels). ``gpus_per_job``: as ``grade``'s (on a GPU
    node: the graded submissions' launches run on CUDA ranks wherever a job has a GPU per rank)."""
    from autograder.grading.grade import grade

    stream = stream or sys.stdout
    labs = labs or all_labs()
    if not labs:
        print("selftest: no labs under solutions/", file=stream)
        return False
    ok = True
    report = []
    with tempfile.TemporaryDirectory(prefix="minidist-selftest-") as tmp:
        tmp = Path(tmp)
        course = build_course(labs, tmp / "course")
        for lab in labs:
            names = lab_notebooks(lab, course / "source")
            source = {n: read_nb(course / "source" / lab / f"{n}.ipynb") for n in names}
            release = {n: read_nb(course / "release" / lab / f"{n}.ipynb") for n in names}
            solution = {n: solution_submission(source[n], release[n]) for n in names}
            bank = load_bank(lab)
            marked = device_discipline(source)
            report.append((lab, "device discipline", "ok" if marked else "--",
                           f"solution and {len(bank['ALTERNATIVES'])} correct alternatives run with "
                           f"{DEFAULT_DEVICE_ENV}=meta in every rank (bugs on the default device)" if marked else
                           "not marked (no metadata minidist.device_discipline in the solution notebook): "
                           "every run on the default device"))
            problems = check_bank(lab, bank, source)
            if bank["path"] is None:
                problems.append(f"no bug bank {bank_file(lab)}")
            subs = tmp / "subs" / lab
            plan = {"solution": ("solution", None)}
            if not (quick and not problems):      # quick: the release is checked in the bank's kernels
                plan["release"] = ("release", None)
            whole = {"solution": solution, "release": release}
            for student in plan:        # grade() grades every folder it finds: only what is reported
                for n in names:
                    write_nb(whole[student][n], subs / student / lab / f"{n}.ipynb")
            for kind, b in [] if quick else [("bug", b) for b in bank["BUGS"]] + \
                    [("alternative", a) for a in bank["ALTERNATIVES"]]:
                try:
                    nbs = inject(b, solution)
                except (BankError, KeyError, TypeError) as e:
                    problems.append(str(e))
                    continue
                student = f"{'bug' if kind == 'bug' else 'alt'}-{b['name']}"
                plan[student] = (kind, b)
                for n, nb in nbs.items():
                    write_nb(nb, subs / student / lab / f"{n}.ipynb")
            for p in problems:
                report.append((lab, "bug bank", "FAIL", p))
                ok = False
            if not problems:
                report.append((lab, "bug bank", "ok", f"{len(bank['BUGS'])} bugs and "
                                                     f"{len(bank['ALTERNATIVES'])} correct alternatives, every "
                                                     "graded function has >= 3 and >= 2"))
            dest = (out / lab) if out else tmp / "out" / lab
            with ThreadPoolExecutor(1) as pool:
                bug_rows = None
                if quick and not problems:
                    # The bank's kernels often wait out deadlock timeouts: grade the solution
                    # meanwhile (its tests run there, and in its confirmation, not in the bank's
                    # kernels), once the first kernel has loaded the notebook.
                    baseline_done = threading.Event()
                    bug_rows = pool.submit(_quick_bug_rows, lab, bank, source, solution,
                                           course / "source" / lab, baseline_done, release, marked)
                    baseline_done.wait()
                meta_runs = {s: META for s, (kind, _) in plan.items() if kind in ("solution", "alternative")}
                r = grade(subs, dest, jobs=jobs, labs=[lab], cell_timeout_s=cell_timeout_s,
                          wall_s=wall_s, progress=progress, job_env=meta_runs if marked else None,
                          gpus_per_job=gpus_per_job)
                if bug_rows is not None:
                    report += bug_rows.result()
            by_student = {j.student: j for j in r["jobs"]}
            from autograder.reports.feedback import collect
            _, leaks = collect(dest)
            report.append((lab, "feedback", "FAIL" if leaks else "ok",
                           "no hidden-test source in any feedback"
                           + (f" -- {len(leaks)} leaks, e.g. {leaks[0]}" if leaks else "")))
            ok &= not leaks
            for student, (kind, bug) in plan.items():
                j = by_student[student]
                rows = {c: row for cells in j.result["cells"].values() for c, row in cells.items()}
                fails = []
                if kind in ("solution", "alternative"):
                    fails = [f"{c}: {row['status']} ({row['reason']})" for c, row in rows.items()
                             if row["status"] != "manual" and
                             (float(row["points"] or 0) < row["max_points"] or row["status"] != "pass")]
                    what = "full marks"
                    pending, manual = manual_points(rows)
                    if pending:
                        what += f" on the automatic tests, {pending:g} points await manual grading ({', '.join(manual)})"
                elif kind == "release":
                    fails = [f"{c}: {float(row['points'] or 0):g} points ({row['status']})"
                             for c, row in rows.items()
                             if row["status"] != "manual" and c not in bank["RELEASE_MAY_PASS"]
                             and float(row["points"] or 0) > 0]
                    fails += [f"{c}: timed out ({row['reason']})" for c, row in rows.items()
                              if row["status"] == "timeout"]
                    what = "0 on every test, no timeout"
                else:
                    what = "loses points on " + ", ".join(bug["catches"])
                    for t in bug["catches"]:
                        row = rows.get(t)
                        if row is None:
                            fails.append(f"{t}: no such test")
                        elif float(row["points"] or 0) >= row["max_points"]:
                            fails.append(f"{t}: still full marks")
                if j.result.get("failure") and kind != "bug":
                    fails.append(j.result["failure"])
                status = "FAIL" if fails else "ok"
                ok &= not fails
                caught = ""
                if kind == "bug":
                    caught = ", ".join(f"{c}={row['status']}" for c, row in rows.items()
                                       if float(row["points"] or 0) < row["max_points"])
                report.append((lab, student, status,
                               what + (f" -- {'; '.join(fails)}" if fails else
                                       (f" [{caught}]" if caught else "")) + f" ({j.seconds:.0f} s)"))
    w = max(len(r[1]) for r in report)
    for lab, who, status, detail in report:
        print(f"{lab:<20} {who:<{w}} {status:<4} {detail}", file=stream)
    n_fail = sum(r[2] == "FAIL" for r in report)
    ok &= n_fail == 0
    print(f"selftest: {'PASSED' if ok else 'FAILED'} ({len(report) - n_fail}/{len(report)} checks ok)",
          file=stream)
    return ok


def _quick_bug_rows(lab, bank, source, solution, workdir, baseline_done: threading.Event,
                    release: dict | None = None, meta: bool = False) -> list[tuple]:
    from autograder.selftest.bugcheck import check_bugs, graded_notebook

    rows = []
    try:
        for k, name in enumerate(source):
            entries = [b for b in bank["BUGS"] if b.get("notebook") in (None, name)]
            if release is not None:
                stubs = {grade_id(c): c.source for c in release[name].cells
                         if nbg(c).get("solution") and c.cell_type == "code"}
                entries.insert(0, dict(name=f"release ({name})", release_cells=stubs,
                                       may_pass=bank["RELEASE_MAY_PASS"]))
            entries += [dict(a, must_pass=alternative_tests(bank, a)) for a in bank["ALTERNATIVES"]
                        if a.get("notebook") in (None, name)]
            done = baseline_done if k == len(source) - 1 else None
            baseline, results = check_bugs(name, graded_notebook(source[name], solution[name]), entries, inject,
                                           str(workdir), done, meta_env=META if meta else None)
            rows += [(lab, "bugs (kernels)", "FAIL", p) for p in baseline]
            for b in entries:
                if b["name"] not in results:
                    continue
                wrong, seconds = results[b["name"]]
                if "release_cells" in b:
                    who, what, why = "release", "0 on every test, no timeout (in a kernel)", "but"
                elif "must_pass" in b:
                    who, what, why = f"alt-{b['name']}", "full marks on " + ", ".join(b["must_pass"]), "lost points on"
                else:
                    rest = len(b["catches"]) - 1
                    who, why = f"bug-{b['name']}", "still full marks on"
                    what = f"loses points on {b['catches'][0]}" + \
                        (f" (and {rest} more it names, checked by the full selftest)" if rest else "")
                rows.append((lab, who, "FAIL" if wrong else "ok",
                             what + (f" -- {why} {', '.join(wrong)}" if wrong else "") + f" ({seconds:.0f} s)"))
    finally:
        baseline_done.set()     # even when a notebook fails early: grading waits on it
    return rows
