"""Confirmation outside the kernel: every graded test again, in a fresh interpreter.

nbgrader runs a submission in a kernel where student code and tests share one process, so a
cell can replace the checks, ``torch.allclose`` or the guard. The confirmation run (inside the
sandbox: :mod:`autograder.confirm_parent`, which writes the verdict and never runs student code,
and its child :mod:`autograder.confirm_runner`) starts from a fresh interpreter, lets the
lab's own setup cells bind pristine minidist checks and torch, and only then loads student
code, and only as the source of the submission's solution cells; the test cells (with their
hidden tests) come from the instructor's source notebook.

A test keeps its notebook score only if the confirmation gives at least as much; a test that
passed in the notebook and fails here scores the confirmation's points (0 for a failed test)
and is flagged ``not confirmed: tampering suspected``. Honest submissions score the same in
both runs, so they keep exactly their notebook scores. A confirmation that fails to confirm a
test is retried once, alone, before the verdict, with every launch timeout ×
``RETRY_TIMEOUT_SCALE``: a loaded machine can make an honest launch time out, and a deadlock
still times out at any scale.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat

from autograder.course import grade_id, nbg
from autograder.notebooks import DEMO_TAG
from minidist.protocol import DOCKET_ENV, GUARD_BINDINGS_ENV

PARENT = Path(__file__).resolve().with_name("confirm_parent.py")
#: what a confirmation runs, copied next to the pristine minidist (standard library and minidist.protocol only)
FILES = ("confirm_parent.py", "confirm_runner.py", "confirm_judge.py", "confirm_audit.py", "confirm_wire.py",
         "handed_in.py")
NOT_CONFIRMED = "not confirmed: tampering suspected"
RETRY_TIMEOUT_SCALE = 3       # MINIDIST_TIMEOUT_SCALE of the retry (minidist.runtime.launcher)


def plan(source_nb, submission_nb) -> list[dict]:
    """The cells a confirmation runs, in notebook order: the lab's locked (setup, given) code
    cells and test cells from the source notebook, the solution cells from the submission
    (the release's stub where the submission has none)."""
    submitted = {grade_id(c): c for c in submission_nb.cells if grade_id(c) and c.get("cell_type") == "code"}
    cells = []
    for c in source_nb.cells:
        if c.cell_type != "code" or DEMO_TAG in c.get("metadata", {}).get("tags", []):
            continue
        m = nbg(c)
        gid = m.get("grade_id")
        if m.get("solution"):
            theirs = submitted.get(gid)
            source = theirs.source if theirs is not None else "raise NotImplementedError()"
            cells.append({"id": gid, "kind": "solution", "source": source})
        elif m.get("grade"):
            cells.append({"id": gid, "kind": "test", "source": c.source})
        elif m.get("locked"):
            cells.append({"id": gid, "kind": "setup" if not cells else "given", "source": c.source})
    return cells


class Confirmation:
    """One confirmation run of one notebook, started now, collected later (:meth:`results`)."""

    def __init__(self, cells, *, pristine: Path, workdir: Path, sandbox, env: dict, timeout: float,
                 cell_timeout: int, log: Path, only: set | None = None, box: dict | None = None):
        self.cells = [c for c in cells if c["kind"] != "test" or only is None or c["id"] in only]
        self.token = secrets.token_hex(16)
        self.messages: list[dict] = []
        self.bad_lines = 0
        self.started = time.time()
        self.timeout = timeout
        workdir.mkdir(parents=True, exist_ok=True)
        read, write = os.pipe()
        spec = {"token": self.token, "path": [str(pristine)], "cells": self.cells, "timeout": cell_timeout,
                "workdir": str(workdir), "env": {"NBGRADER_EXECUTION": "autograde", GUARD_BINDINGS_ENV: "1", DOCKET_ENV: "1"},
                "own_pids": sandbox is not None}      # the sandbox is a PID namespace of this run's own
        from autograder.sandbox import command
        argv = command(sandbox, [sys.executable, "-I", str(pristine / PARENT.name), "--fd", str(write)],
                       rw=[str(workdir)], cwd=str(workdir), env=env, ro_extra=[str(pristine)], **(box or {}))
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=self.log,
                                     pass_fds=(write,), env=env if sandbox is None else _outer_env(env),
                                     cwd=str(workdir), start_new_session=True)
        os.close(write)
        self.reader = threading.Thread(target=self._read, args=(read,), daemon=True)
        self.reader.start()
        try:
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
        except OSError:
            pass

    def _read(self, fd):
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                if len(self.messages) > 10_000:
                    break
                try:
                    msg = json.loads(raw[:1_000_000])
                except ValueError:
                    self.bad_lines += 1
                    continue
                if isinstance(msg, dict) and msg.get("token") == self.token:
                    self.messages.append(msg)
                else:
                    self.bad_lines += 1

    def wait(self) -> None:
        left = max(1.0, self.timeout - (time.time() - self.started))
        try:
            self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(timeout=5)
        self.log.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def results(self) -> dict:
        """{test id: outcome} with outcome = {error, stderr, value, changed, seconds} as reported,
        plus 'notes' (restored bindings, flags) and 'done' (the run reached its end)."""
        out = {"tests": {}, "restored": [], "flags": [], "cells": {}, "done": False, "exit": self.proc.returncode}
        for m in self.messages:
            ev = m.get("event")
            if ev == "test" and isinstance(m.get("cell"), str):
                out["tests"][m["cell"]] = m
            elif ev == "restored":
                out["restored"] += [f"{m.get('cell')}: {c}" for c in m.get("changes", [])][:20]
            elif ev == "flags":
                out["flags"] += [tuple(map(str, f))[:2] for f in m.get("items", []) if isinstance(f, list)]
            elif ev == "cell":
                out["cells"][str(m.get("cell"))] = m
            elif ev == "done":
                out["done"] = True
        return out


def _outer_env(env: dict) -> dict:
    """The environment of the sandbox launcher itself (what runs inside gets ``env``)."""
    from autograder.procs import TAG_VAR
    from autograder.sandbox import outer_env
    return outer_env(env, TAG_VAR)


def confirmed_points(outcome: dict | None, max_points: float) -> tuple[float, str]:
    """(points, why) the confirmation gives one test, by nbgrader's rules (``determine_grade``)."""
    from nbgrader.utils import determine_grade
    if outcome is None:
        return 0.0, "the confirmation run did not reach this test"
    outputs = []
    if outcome.get("error"):
        ename, evalue = (list(outcome["error"]) + ["", ""])[:2]
        outputs.append(nbformat.v4.new_output("error", ename=str(ename), evalue=str(evalue), traceback=[]))
    if outcome.get("stderr"):
        outputs.append(nbformat.v4.new_output("stream", name="stderr", text=str(outcome["stderr"])))
    if outcome.get("value") is not None:
        outputs.append(nbformat.v4.new_output("execute_result", data={"text/plain": str(outcome["value"])},
                                              execution_count=1))
    cell = nbformat.v4.new_code_cell("", outputs=outputs)
    cell.metadata["nbgrader"] = {"grade": True, "solution": False, "points": max_points, "grade_id": "x"}
    try:
        points, _ = determine_grade(cell)
    except Exception:
        points = 0.0
    points = min(float(points or 0.0), max_points)
    if outcome.get("changed"):
        return 0.0, "the test's checks or torch were changed while it ran: " + ", ".join(outcome["changed"][:3])
    if outcome.get("error"):
        ename, evalue = (list(outcome["error"]) + ["", ""])[:2]
        return points, f"{ename}: {str(evalue).strip().splitlines()[0][:200] if str(evalue).strip() else ''}".rstrip(": ")
    if outcome.get("stderr") and points < max_points:
        return points, "wrote to stderr: " + str(outcome["stderr"]).strip()[:120]
    return points, "passed"


def copy_pristine(dest: Path) -> Path:
    """A copy of the minidist the grader imports (and of the runner), made when the batch starts:
    kernels and confirmations import this one, read-only, whatever happens to the repository."""
    import minidist
    src = Path(minidist.__file__).resolve().parent
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(src, dest / "minidist", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name in FILES:
        shutil.copy2(PARENT.with_name(name), dest / name)
    # readable by the jobs' uids whatever the checkout's modes (a clone made under a 0077 umask)
    for root, dirs, files in os.walk(dest):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return dest


def confirm_cells(cells: dict, runs: dict, start, deadline) -> dict:
    """Apply the confirmation to the notebook's per-test results (in place); returns a summary."""
    from autograder.confirm import NOT_CONFIRMED, confirmed_points
    summary = {"ran": True, "notebooks": {}}
    for name, run in runs.items():
        run.wait()
        res = run.results()
        rows = cells.get(name, {})
        unconfirmed = _unconfirmed(rows, res, confirmed_points)
        attempts = 1
        if unconfirmed and time.time() < deadline - 10:       # once more, alone: a loaded machine is no tamperer
            retry = start(name, only=set(unconfirmed), attempt=2)
            retry.wait()
            res2 = retry.results()
            attempts = 2
            for cid in unconfirmed:
                if cid in res2["tests"]:
                    res["tests"][cid] = res2["tests"][cid]
            res["flags"] += res2["flags"]
            unconfirmed = _unconfirmed(rows, res, confirmed_points)
        for cid, row in rows.items():
            if row["status"] == "manual":
                continue
            pts, why = confirmed_points(res["tests"].get(cid), row["max_points"])
            if not res["done"] and cid not in res["tests"]:
                why = f"the confirmation run stopped before this test (exit {res['exit']})"
            row["confirmed"] = why if pts >= float(row["points"] or 0) else f"failed: {why}"
            if float(row["points"] or 0) > pts:
                row["flags"].append(f"{NOT_CONFIRMED} (passed in the notebook; in a fresh interpreter: {why})")
                row["points"] = pts
                row["status"] = "fail"
                row["reason"] = f"{NOT_CONFIRMED}: {why}"[:300]
        notes = []
        if res["restored"]:
            notes.append("the solution cells changed minidist/torch (put back before the tests): "
                         + "; ".join(res["restored"][:6]))
        if res["flags"]:
            seen = []
            for f in res["flags"]:
                if f not in seen:
                    seen.append(f)
            notes.append("the confirmation run saw (no score change): " + "; ".join(": ".join(f) for f in seen[:10]))
        summary["notebooks"][name] = {"attempts": attempts, "done": res["done"], "notes": notes,
                                      "unconfirmed": unconfirmed}
    return summary


def _unconfirmed(rows, res, confirmed_points) -> list[str]:
    out = []
    for cid, row in rows.items():
        if row["status"] == "manual":
            continue
        pts, _ = confirmed_points(res["tests"].get(cid), row["max_points"])
        if float(row["points"] or 0) > pts:
            out.append(cid)
    return out


def report_points(runs: dict, cells_meta: dict, send) -> None:
    """As each notebook's confirmation run ends, send its points per test to the grader
    (``{"type": "confirmation", ...}``): if the worker is then killed at the wall-clock limit, the
    grader keeps a test's notebook points only as far as these confirm them."""
    for name, run in runs.items():
        run.wait()
        res = run.results()
        send({"type": "confirmation", "notebook": name,
              "points": {m["name"]: confirmed_points(res["tests"].get(m["name"]), m["max_score"])[0]
                         for m in cells_meta.get(name, []) if m["kind"] != "manual"}})
