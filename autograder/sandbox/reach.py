"""Before the first job: can a job's uid reach what it needs? (issue 47)

A grader started as root runs every job on an unprivileged uid of its own
(:func:`autograder.sandbox.backend.job_uid`). The sandbox binds what a job needs (the interpreter, its
packages, the pristine minidist, the sandbox's own tools) at the same paths in a new root whose
folders *above* those binds are fresh and traversable, so a course in a private home (``/root``,
a ``mktemp -d`` folder) works. What the sandbox cannot change is the mode of a bound folder itself
or of what lies below it: a virtual environment made 0700, a site-packages installed under a
0077 umask. A job would then fail to start its kernel, and every submission would lose its points
to a machine's setting. So the grader asks first, once per batch, from inside the sandbox, as a
job's uid: one small POSIX shell script (no Python: the interpreter may be what is out of reach)
walks each needed path from ``/`` and names the first folder it cannot traverse or the file it
cannot read. :func:`explain` turns that into one message for the instructor: the path, the folder
that blocks it, its mode and owner, and what to do.
"""
from __future__ import annotations

import importlib.util
import os
import pwd
import stat
import sys
import sysconfig

#: run as ``sh -c WALK sh KIND:PATH ...`` (KIND ``x``: executable, ``r``: readable): prints
#: ``blocked|PATH|FOLDER`` for each path out of reach (``missing|...`` where FOLDER is not in the
#: sandbox at all), then ``done``
WALK = r"""
set -f
for arg in "$@"; do
  want=${arg%%:*}; p=${arg#*:}; d=""; ok=1
  old=$IFS; IFS=/
  for part in $p; do
    [ -z "$part" ] && continue
    d="$d/$part"
    if ! [ -e "$d" ]; then echo "missing|$p|$d"; ok=0; break; fi
    [ "$d" = "$p" ] && break
    if ! [ -x "$d" ]; then echo "blocked|$p|$d"; ok=0; break; fi
  done
  IFS=$old
  [ $ok = 1 ] || continue
  if [ -d "$p" ]; then
    { [ -x "$p" ] && [ -r "$p" ]; } || echo "blocked|$p|$p"
  elif [ "$want" = x ]; then
    [ -x "$p" ] || echo "blocked|$p|$p"
  else
    [ -r "$p" ] || echo "blocked|$p|$p"
  fi
done
echo done
"""


def needs(extra=(), programs=()) -> list[str]:
    """``KIND:PATH`` for what a job's processes open first: the interpreter (as called and its real
    file) and ``programs`` (the kernel's, from its spec), the standard library, the package folders,
    a few packages every job imports, and ``extra`` (the pristine minidist's ``__init__.py``, the
    sandbox's tools)."""
    out = [f"x:{p}" for exe in (sys.executable, *programs) for p in (exe, os.path.realpath(exe))]
    paths = sysconfig.get_paths()
    out.append(f"r:{os.path.join(paths['stdlib'], 'os.py')}")
    for key in ("purelib", "platlib"):
        out.append(f"r:{paths[key]}")
    for module in ("torch", "ipykernel", "numpy"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            out.append(f"r:{spec.origin}")
    out += [f"r:{p}" for p in extra]
    seen: list[str] = []
    return [p for p in out if not (p in seen or seen.append(p))]


def blocked(stdout: str) -> list[tuple[str, str, str]] | None:
    """[(how, path, the folder or file that blocks it)] from :data:`WALK`'s output (how: ``blocked`` or
    ``missing``); None if it did not finish."""
    lines = stdout.strip().splitlines()
    if not lines or lines[-1].strip() != "done":
        return None
    return [tuple(line.split("|")[:3]) for line in lines[:-1] if line.startswith(("blocked|", "missing|"))]


def _mode(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError as err:
        return f"cannot be read: {err.strerror}"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner {owner}"


def explain(found: list[tuple[str, str, str]], uid: int | None, sandboxed: bool = True) -> str:
    """The one message that stops the grader: each path, what blocks it, and what to do (``sandboxed``
    False: no sandbox works here, and a root grader's jobs still run as their own uid)."""
    who = f"its own unprivileged uid ({uid})" if uid is not None else "the grader's uid inside a user namespace"
    lines = [f"autograder: the grading jobs cannot reach what they need. Each job runs in a sandbox as {who}; "
             f"the sandbox makes every folder above what a job needs traversable, but not the folders below:"
             if sandboxed else
             f"autograder: the grading jobs cannot reach what they need. No sandbox works here, so each job runs "
             f"as {who} on the machine's own folders (never as root), and these are out of its reach:"]
    folders, missing = [], False
    for how, path, where in found:
        if how == "missing":
            missing = True
            lines.append(f"  {path}: not in the sandbox ({where} is outside the grader's interpreter and its "
                         f"packages, all a job is shown)")
            continue
        lines.append(f"  {path}: blocked at {where} ({_mode(where)})")
        if where not in folders:
            folders.append(where)
    fixes = []
    if folders:
        fixes.append("let other users read these (chmod -R o+rX " + " ".join(f"'{f}'" for f in folders) + ")")
    if missing:
        fixes.append("run the grader with the interpreter its kernel uses, with every package installed in that "
                     "environment (not reached through a .pth file or PYTHONPATH pointing elsewhere)")
    if not sandboxed:
        fixes.append("allow unprivileged user namespaces (or install bubblewrap) so that the sandbox works")
    fixes.append("or run the grader as an ordinary user")
    return "\n".join(lines + ["What to do: " + "; ".join(fixes) + ". Nothing was graded."])
