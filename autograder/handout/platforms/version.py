"""Which version of the course a bundle grades with: its record (``bundle.json``), and what has
changed in the course since it was built.

A bundle grades with copies of the course's files; once an exercise changes, an old bundle goes on
grading with the old one. Each bundle therefore records, in ``bundle.json`` at its root, the lab, when
it was built, the commit it was built from (and whether files it depends on had uncommitted
changes), and a fingerprint of everything grading depends on, in parts:

* ``notebook``: the lab's source folder, ``solutions/LAB/`` (what the tests, hidden tests and locked
  cells come from), but its bug bank, which no bundle holds; a notebook counts by its cells' type,
  source and metadata and its kernel, not by outputs or execution counts;
* ``checks``: the lab's checks package, ``minidist/checks/LAB/`` (its cases, hidden cases, answers);
* ``kit``: the checks' shared machinery, ``minidist/checks/kit/`` and ``minidist/checks/*.py``;
* ``library``: the rest of ``minidist/`` (the code the kernels and the confirmation import);
* ``grader``: ``autograder/``, as the bundle ships it;
* ``packages``: the pinned versions of torch and the grader's packages (``requirements.txt``).

A part's fingerprint is a SHA-256 over its files' paths and contents (documentation, ``*.md``, and
caches left out); the bundle's fingerprint is one over the parts'. Every graded result names the
bundle (:func:`describe`: the instructor's output), and :func:`check` compares a bundle's record with
the course as it is here and names what changed, part by part and file by file
(``python -m autograder gradescope LAB --check ZIP``, ``prairielearn LAB --check DIR``).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
import zipfile
from pathlib import Path

from autograder import PACKAGE_DIR, REPO

RECORD = "bundle.json"
PARTS = {"notebook": "the lab's notebook folder", "checks": "the lab's checks", "kit": "the checks kit",
         "library": "the library (minidist)", "grader": "the grader (autograder)",
         "packages": "the pinned packages"}
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def _files(root: Path, skip=lambda p: False):
    """Every file under ``root`` that grading can depend on, sorted."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and not _SKIP_DIRS & set(p.relative_to(root).parts)
                  and not p.name.endswith((".pyc", ".md")) and not p.name.startswith(".") and not skip(p))


def _digest(path: Path) -> str:
    if path.suffix == ".ipynb":            # the cells and the kernel, not outputs or execution counts
        nb = json.loads(path.read_text())
        cells = [{"cell_type": c.get("cell_type"), "source": "".join(c.get("source") or []),
                  "metadata": c.get("metadata") or {}} for c in nb.get("cells", [])]
        kernel = (nb.get("metadata") or {}).get("kernelspec") or {}
        data = json.dumps({"cells": cells, "kernel": kernel.get("name")}, sort_keys=True).encode()
    else:
        data = path.read_bytes()
    return hashlib.sha256(data).hexdigest()


def _part(files: dict[str, str]) -> dict:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return {"sha256": h.hexdigest(), "files": files}


def parts(lab: str) -> dict[str, dict]:
    """{part: {"sha256": ..., "files": {path: sha256}}} of the course as it is here, for ``lab``."""
    from autograder.course.labs import BANK_FILE, solutions_dir
    from autograder.handout.platforms.bundle import requirements, torch_version
    lib, checks = REPO / "minidist", REPO / "minidist" / "checks"
    sol = solutions_dir()

    def rel(paths, base):
        return {str(p.relative_to(base)): _digest(p) for p in paths}
    return {
        "notebook": _part(rel(_files(sol / lab, skip=lambda p: p.name == BANK_FILE), sol.parent)),
        "checks": _part(rel(_files(checks / lab), REPO)),
        "kit": _part(rel(_files(checks / "kit") + [p for p in _files(checks) if p.parent == checks], REPO)),
        "library": _part(rel(_files(lib, skip=lambda p: checks in p.parents), REPO)),
        "grader": _part(rel(_files(PACKAGE_DIR), REPO)),
        "packages": _part({"requirements.txt": hashlib.sha256(requirements().encode()).hexdigest(),
                           "torch": hashlib.sha256(torch_version().encode()).hexdigest()}),
    }


def fingerprint(p: dict[str, dict]) -> str:
    return hashlib.sha256("".join(f"{k}={p[k]['sha256']};" for k in sorted(p)).encode()).hexdigest()


def commit() -> str | None:
    """The checkout's commit, marked when files grading depends on have uncommitted changes (None: not
    a git checkout, or no git)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "minidist", "autograder",
                                "solutions"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def record(lab: str) -> dict:
    """What ``bundle.json`` holds for a bundle of ``lab`` built now, here."""
    p = parts(lab)
    return {"lab": lab, "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(),
            "fingerprint": fingerprint(p), "parts": p}


def write_record(lab: str, dest: Path) -> Path:
    path = Path(dest) / RECORD
    path.write_text(json.dumps(record(lab), indent=1, sort_keys=True) + "\n")
    return path


def read_record(path: Path) -> dict:
    """A bundle's record: ``path`` is a Gradescope zip, a folder holding ``bundle.json`` (a bundle, or
    PrairieLearn's output folder with its ``grader-image/``), or the file itself."""
    path = Path(path)
    try:
        if path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                return json.loads(z.read(RECORD))
        for candidate in (path, path / RECORD, path / "grader-image" / RECORD):
            if candidate.is_file():
                return json.loads(candidate.read_text())
    except KeyError:
        raise SystemExit(f"{path}: no {RECORD} in it (a bundle built before bundles recorded their version: "
                         f"rebuild it)") from None
    except ValueError as err:
        raise SystemExit(f"{path}: {RECORD} is not readable: {err}") from None
    raise SystemExit(f"{path}: no bundle there (a {RECORD}, a folder holding one, or a Gradescope zip)")


def describe(rec: dict | None) -> str:
    """One line naming a bundle (for the instructor's output of every graded result)."""
    if not rec:
        return "bundle: no record (not graded from a bundle, or one built before bundles recorded their version)"
    return (f"bundle: {rec.get('lab')}, fingerprint {str(rec.get('fingerprint'))[:12]}, built {rec.get('built')}"
            f" from commit {rec.get('commit') or 'unknown'}")


def load_for_run(path) -> dict | None:
    """The record a grader runs with (None where there is none: the grader says so, and grades)."""
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def changes(old: dict, new: dict, most: int = 5) -> list[str]:
    """One line per part that differs between two records' parts, naming its files."""
    out = []
    for key, what in PARTS.items():
        a, b = (old.get(key) or {}), (new.get(key) or {})
        if a.get("sha256") == b.get("sha256"):
            continue
        fa, fb = a.get("files") or {}, b.get("files") or {}
        files = ([f"{n} (changed)" for n in sorted(fa) if n in fb and fa[n] != fb[n]]
                 + [f"{n} (new)" for n in sorted(fb) if n not in fa]
                 + [f"{n} (removed)" for n in sorted(fa) if n not in fb])
        shown = ", ".join(files[:most]) + (f", and {len(files) - most} more" if len(files) > most else "")
        out.append(f"{what} changed: {shown or 'its record differs'}")
    return out


def check(lab: str, path: Path) -> tuple[bool, str]:
    """(the bundle at ``path`` grades with the course as it is here, the report)."""
    rec = read_record(path)
    if rec.get("lab") != lab:
        raise SystemExit(f"{path}: a bundle of {rec.get('lab')!r}, not of {lab!r}")
    now = parts(lab)
    head = f"{path}: {describe(rec)}"
    if rec.get("fingerprint") == fingerprint(now):
        return True, f"{head}\nup to date: the course here grades {lab} as this bundle does"
    lines = changes(rec.get("parts") or {}, now)
    return False, "\n".join([head, "OUT OF DATE: the course here has changed since the bundle was built:"]
                            + [f"  {line}" for line in lines]
                            + ["rebuild the bundle and upload it again to grade with the course as it is now"])
