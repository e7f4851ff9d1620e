"""Submission notebooks: find them, repair their structure, classify test outcomes."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from autograder.course.cells import grade_id, nbg, normalized

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# --------------------------------------------------------------------------- locating
def locate(sub_dir: Path, name: str, others: list[str], release_nbs: dict) -> tuple[Path | None, list[str]]:
    """Find notebook ``name`` in a student's lab directory.

    Returns (path or None, notes).  A wrongly named notebook is accepted when it is
    the best match (by shared cell ids with the release) among notebooks that are
    not themselves expected under another name.
    """
    expected = sub_dir / f"{name}.ipynb"
    if expected.is_file():
        return expected, []
    taken = {f"{o}.ipynb" for o in others}
    cands = sorted(p for p in sub_dir.rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts and p.name not in taken)
    if not cands:
        return None, [f"missing notebook {name}.ipynb"]
    ref_ids = {grade_id(c) for c in release_nbs[name].cells if grade_id(c)}

    def overlap(p):
        try:
            nb = nbformat.read(str(p), as_version=4)
            return len(ref_ids & {grade_id(c) for c in nb.cells if grade_id(c)})
        except Exception:
            return -1
    best = max(cands, key=lambda p: (overlap(p), -cands.index(p)))
    rel = best.relative_to(sub_dir)
    return best, [f"notebook submitted as {str(rel)!r}; graded as {name}.ipynb"]


def load(path: Path):
    """Parse a notebook; raises ValueError with a one-line reason if it is unusable."""
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # corrupt JSON, wrong schema, binary junk ...
        msg = str(e).strip().split("\n")[0][:160]
        raise ValueError(f"{path.name} is not a readable notebook ({type(e).__name__}: {msg})") from None
    if not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path.name} has no cell list")
    for c in nb.cells:
        c.setdefault("metadata", {})
        if isinstance(c.get("source"), list):
            c.source = "".join(c.source)
    return nb


# --------------------------------------------------------------------------- repair
def _kind(cell) -> str:
    m = nbg(cell)
    if m.get("solution"):
        return "solution:" + cell.get("cell_type", "")
    if m.get("grade") or m.get("locked") or m.get("task"):
        return "locked:" + cell.get("cell_type", "")
    return "other"


#: the one note for a notebook handed in from the course's source (nbgrader's metadata without the
#: release's checksums, the hidden tests in its test cells) instead of a "restored" flag per cell
FROM_SOURCE = "handed in from the source notebook (solutions/, with the hidden tests): its {n} locked cells were put back as released"


def repair(nb, ref, source=None) -> tuple[object, dict[str, list[str]], list[str]]:
    """Restore the graded structure of ``nb`` from the release notebook ``ref``.

    * cells whose nbgrader id was changed (renamed) get the id of the release cell of
      the same kind that is missing; unknown ids are stripped;
    * duplicated ids: the first copy is kept, later ones stripped;
    * graded/locked cells that were deleted are re-inserted where they were;
    * nbgrader metadata of locked and graded cells is reset to the release's;
    * locked cells whose source changed are flagged (nbgrader's OverwriteCells
      restores their source, including hidden tests, from the gradebook).

    A cell exactly as in the source notebook ``source`` (its metadata, and for a locked cell its text)
    is put back the same way, but flagged once for the notebook (:data:`FROM_SOURCE`), not per cell.

    Returns (notebook, {grade_id: [flags]}, [notebook-level flags]).
    """
    nb = copy.deepcopy(nb)
    flags: dict[str, list[str]] = {}
    notes: list[str] = []
    ref_cells = [c for c in ref.cells if grade_id(c)]
    ref_by_id = {grade_id(c): c for c in ref_cells}
    present: dict[str, object] = {}
    unknown = []
    for c in nb.cells:
        gid = grade_id(c)
        if gid is None:
            if nbg(c).get("grade") or nbg(c).get("solution") or nbg(c).get("locked"):
                unknown.append(c)
            continue
        if gid in ref_by_id and gid not in present:
            present[gid] = c
        elif gid in present:
            del c.metadata["nbgrader"]
            notes.append(f"duplicate copy of cell {gid!r} ignored")
        else:
            unknown.append(c)
    missing = [grade_id(c) for c in ref_cells if grade_id(c) not in present]
    for u in unknown:
        old = grade_id(u)
        cand = [m for m in missing if _kind(ref_by_id[m]) == _kind(u)]
        if cand:
            m = cand[0]
            missing.remove(m)
            u.metadata["nbgrader"] = copy.deepcopy(ref_by_id[m].metadata["nbgrader"])
            present[m] = u
            flags.setdefault(m, []).append(
                f"cell id changed to {old!r}; restored" if old else "cell id removed; restored")
        else:
            del u.metadata["nbgrader"]
            notes.append(f"unknown graded cell {old!r} treated as an ordinary cell")
    # re-insert deleted cells after the nearest preceding graded cell that is present
    order = [grade_id(c) for c in ref_cells]
    for gid in order:
        if gid not in missing:
            continue
        i = order.index(gid)
        pos = 0
        for prev in reversed(order[:i]):
            if prev in present:
                pos = next(k for k, c in enumerate(nb.cells) if c is present[prev]) + 1
                break
        new = copy.deepcopy(ref_by_id[gid])
        nb.cells.insert(pos, new)
        present[gid] = new
        what = "solution cell" if nbg(new).get("solution") else "cell"
        flags.setdefault(gid, []).append(f"{what} was deleted; restored from the release")
    # metadata and locked sources
    src_by_id = {grade_id(c): c for c in source.cells if grade_id(c)} if source is not None else {}
    from_source = set()
    for gid, c in present.items():
        r, s = ref_by_id[gid], src_by_id.get(gid)
        if _kind(r).startswith("locked") or nbg(r).get("grade"):
            if nbg(c) != nbg(r) and not any("restored" in f for f in flags.get(gid, [])):
                if s is not None and nbg(c) == nbg(s):
                    from_source.add(gid)
                else:
                    flags.setdefault(gid, []).append("grading metadata changed; restored")
            c.metadata["nbgrader"] = copy.deepcopy(r.metadata["nbgrader"])
        if c.get("cell_type") != r.get("cell_type"):
            flags.setdefault(gid, []).append(f"cell type changed to {c.get('cell_type')}; restored")
        if nbg(r).get("locked") and not nbg(r).get("solution") and normalized(c.source) != normalized(r.source) \
                and not any("deleted" in f for f in flags.get(gid, [])):
            if s is not None and normalized(c.source) == normalized(s.source):
                from_source.add(gid)
            else:
                flags.setdefault(gid, []).append("locked cell was modified; restored")
    if from_source:
        notes.append(FROM_SOURCE.format(n=len(from_source)))
    return nb, flags, notes


# --------------------------------------------------------------------------- outcomes
def _one_line(text: str, limit: int = 240) -> str:
    lines = [l.strip() for l in _ANSI.sub("", str(text)).split("\n") if l.strip()]
    s = " | ".join(lines[:2]) if lines else ""
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _launch_line(evalue: str) -> str:
    """A LaunchError in one line: its first line and the first rank report (what was raised,
    where a rank was blocked), which a check's prefix would otherwise push out."""
    lines = [l.strip() for l in _ANSI.sub("", evalue).split("\n") if l.strip()]
    if not lines:
        return ""
    rank = next((l for l in lines[1:] if re.match(r"ranks? [\d, -]+ (raised|failed|blocked|killed|exited|still)", l)
                 or re.match(r"rank \d+: ", l)), None)          # "ranks 0-7 raised": identical reports folded
    head = lines[0] if len(lines) == 1 or not lines[0].endswith(":") else f"{lines[0]} {lines[1]}"
    s = f"{head} | {rank}" if rank and rank not in head else head
    return s if len(s) <= 240 else s[:237] + "..."


def classify(cell, points, max_points, cell_timeout) -> tuple[str, str]:
    """(status, one-line reason) for an executed graded code cell."""
    outputs = cell.get("outputs", []) if cell is not None else []
    for o in outputs:
        if o.get("output_type") != "error":
            continue
        ename, evalue = o.get("ename", ""), _ANSI.sub("", o.get("evalue", ""))
        if ename in ("CellTimeoutError", "KeyboardInterrupt"):
            return "timeout", f"cell did not finish within the {cell_timeout:g} s cell timeout (interrupted)"
        if ename == "LaunchError" and re.search(r"timed out|deadlock|stuck|still running", evalue):
            return "timeout", "LaunchError: " + _launch_line(evalue)
        if ename == "LaunchError":
            return "error", "LaunchError: " + _launch_line(evalue)
        if ename == "AssertionError":
            return "fail", "AssertionError" + (": " + _one_line(evalue) if evalue.strip() else "")
        return "error", f"{ename}: {_one_line(evalue)}".rstrip(": ")
    if points is not None and max_points and points >= max_points:
        return "pass", "passed"
    for o in outputs:
        if o.get("output_type") == "stream" and o.get("name") == "stderr":
            return "fail", ("wrote to stderr, which nbgrader scores as a failure: "
                            + _one_line(o.get("text", ""), 160))
    if points is None:
        return "manual", "needs manual grading"
    if points > 0:
        return "fail", f"partial credit {points:g}/{max_points:g}"
    return "fail", "scored 0"
