"""What a confirmation runs (:func:`plan`), and starting one in the sandbox (:class:`Confirmation`),
from the pristine copy of minidist and of this package's sandbox-side files (:func:`copy_pristine`).
See :mod:`autograder.confirm`.
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

from autograder.confirm import hidden_tables, warm
from autograder.course.cells import DEMO_TAG, grade_id, nbg
from autograder.course.hidden_tests import HIDDEN_PART, split
from autograder.sandbox.backend import command
from autograder.sandbox.home import outer_env
from autograder.sandbox.procs import TAG_VAR
from minidist.protocol import DOCKET_ENV, GUARD_BINDINGS_ENV

HERE = Path(__file__).resolve().parent
#: what a confirmation runs in the sandbox, copied next to the pristine minidist (standard library and minidist only)
FILES = ("__init__.py", "parent.py", "warm.py", "runner.py", "judge.py", "audit.py", "wire.py", "handed_in.py",
         "hidden_tables.py")
PRISTINE_PACKAGE = Path("autograder", "confirm")      # where they are, below the pristine copy



def plan(source_nb, submission_nb) -> list[dict]:
    """The cells a confirmation runs, in notebook order: the lab's locked (setup, given) code
    cells and test cells from the source notebook, the solution cells from the submission
    (the release's stub where the submission has none). A test cell with hidden tests is two tests,
    its visible part (the cell's id) and its hidden part (the id and ``/hidden``), scored apart
    (:mod:`autograder.course.hidden_tests`)."""
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
        elif m.get("grade"):          # its visible and its hidden tests: two tests, scored apart
            visible, hidden = split(c.source)
            if visible.strip() or not hidden.strip():
                cells.append({"id": gid, "kind": "test", "source": visible})
            if hidden.strip():
                cells.append({"id": gid + HIDDEN_PART, "kind": "test", "source": hidden})
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
        setup = [c["source"] for c in self.cells if c["kind"] in ("setup", "given")]
        # the whole run's environment: the parent imports the checks, which read these once, before it forks
        run_env = {"NBGRADER_EXECUTION": "autograde", GUARD_BINDINGS_ENV: "1", DOCKET_ENV: "1"}
        env = dict(env, **run_env)
        spec = {"token": self.token, "path": [str(pristine)], "cells": self.cells, "timeout": cell_timeout,
                "hidden": hidden_tables.tables(setup),      # never a file: the kernel has the same view
                "workdir": str(workdir), "env": run_env,
                "own_pids": sandbox is not None}      # the sandbox is a PID namespace of this run's own
        preload = warm.modules(setup)         # the parent imports them before it forks the judge and the child
        argv = command(sandbox, [sys.executable, "-I", str(pristine / PRISTINE_PACKAGE / "parent.py"), "--fd",
                                 str(write), *(["--preload", ",".join(preload)] if preload else [])],
                       rw=[str(workdir)], cwd=str(workdir), env=env, ro_extra=[str(pristine)], **(box or {}))
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=self.log,
                                     pass_fds=(write,), env=env if sandbox is None else outer_env(env, TAG_VAR),
                                     cwd=str(workdir), start_new_session=True)
        os.close(write)
        self.reader = threading.Thread(target=self._read, args=(read,), daemon=True)
        self.reader.start()
        # on a thread: the parent reads its spec only once it has imported torch and forked (seconds)
        threading.Thread(target=self._write_spec, args=(json.dumps(spec).encode(),), daemon=True).start()

    def _write_spec(self, data: bytes):
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except (OSError, ValueError):
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


def copy_pristine(dest: Path, hidden: bool = False) -> Path:
    """A copy of the minidist the grader imports, and of this package's sandbox-side files (as
    ``autograder/confirm/`` next to it, with the package's light ``__init__``), made when the batch
    starts: kernels and confirmations import these, read-only, whatever happens to the repository.

    Without the labs' hidden case tables (``minidist/checks/<lab>/hidden.py``): a kernel that could
    read them could print them into a visible test's output; the confirmation gets them from the
    grader (:mod:`autograder.confirm.hidden_tables`). ``hidden=True`` (a batch without the
    confirmation, whose kernels then run the hidden tests themselves) puts them in."""
    import minidist
    src = Path(minidist.__file__).resolve().parent
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    tables = src / "checks"

    def leave_out(folder, names):
        skip = {n for n in names if n == ".ipynb_checkpoints" or n == "__pycache__"}
        if Path(folder).parent == tables:
            skip.add("hidden.py")
        return skip
    shutil.copytree(src, dest / "minidist", ignore=leave_out)
    if hidden:
        for lab in sorted(p.name for p in (dest / "minidist" / "checks").iterdir() if p.is_dir()):
            path = hidden_tables.table_file(hidden_tables.CHECKS_PACKAGE + lab)
            if path is not None:
                shutil.copyfile(path, dest / "minidist" / "checks" / lab / "hidden.py")
    (dest / PRISTINE_PACKAGE).mkdir(parents=True)
    shutil.copy2(HERE.parent / "__init__.py", dest / "autograder" / "__init__.py")
    for name in FILES:
        shutil.copy2(HERE / name, dest / PRISTINE_PACKAGE / name)
    # readable by the jobs' uids whatever the checkout's modes (a clone made under a 0077 umask)
    for root, dirs, files in os.walk(dest):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return dest


