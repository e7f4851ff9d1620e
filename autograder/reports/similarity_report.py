"""What ``python -m autograder similarity OUT`` writes: ``similarity.html`` and ``results.csv``'s column.

The pairs come from :mod:`autograder.reports.similarity`. ``similarity.html`` has one entry per pair (two
students, or a student and minidist), highest score first: the flagged pairs, then the near misses,
marked as not flagged. Each lists every cell the two share with its score (against minidist also the
library functions that hold the shared code and what the lab's own solution scores), then the cells
from the near-miss level side by side with the shared code marked (of the library, only the lines
around what is shared); every name and every line of code is escaped. ``results.csv`` gets one
column, ``similarity``: for a test's row, the highest flagged score among the answer cells that test
calls (the cells defining a name the test cell uses) and with whom, or nothing. No other column and no
other file changes: a flag asks a person to read two answers, it is no verdict.
"""
from __future__ import annotations

import ast
import csv
import html
import os
import re
from pathlib import Path

from autograder.grading.results import RESULT_FIELDS
from autograder.reports import similarity

#: lines of context kept around the shared code of the library's modules (they are long)
LIBRARY_CONTEXT_LINES = 3


def other_name(match: similarity.Match, student: str | None = None) -> str:
    """Who the answer of ``student`` (default: the match's first) resembles: a classmate, or the library's
    functions that hold the shared code."""
    if match.b.library:
        units = similarity.matched_units(match)
        return "minidist (" + ", ".join(units[:3]) + ")" if units else "minidist"
    return match.a.who if student == match.b.who else match.b.who


def pair_name(pair: similarity.Pair) -> str:
    return f"{pair.a} and {'minidist' if pair.library else pair.b}"


def _marked(text: similarity.Text, slices, context: int = -1) -> str:
    from copydetect.utils import highlight_overlap
    import numpy as np
    spans = np.asarray(slices, dtype=int).reshape(2, -1) if len(slices) else np.zeros((2, 0), dtype=int)
    if spans.shape[1] == 0:
        return html.escape(text.source) if context < 0 else ""
    order = np.argsort(spans[0])
    marked, _ = highlight_overlap(text.source, spans[:, order], "<mark>", "</mark>", truncate=context,
                                  escape_html=True)
    return marked


def _stub(releases: dict | None, m: similarity.Match) -> str:
    return (releases or {}).get((m.a.lab, m.a.notebook), {}).get(m.a.cell, "")


def _status(pair: similarity.Pair) -> str:
    return "flagged" if pair.flagged else "near miss, not flagged"


def write_html(path: Path, pairs: list[similarity.Pair], texts: list[similarity.Text], out: Path,
               releases: dict | None = None, near_miss: float = similarity.NEAR_MISS) -> None:
    esc = html.escape
    cells = {(t.lab, t.notebook, t.cell) for t in texts}
    flagged = [p for p in pairs if p.flagged]
    near = [p for p in pairs if not p.flagged]
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>Similarity report</title><style>"
             "body{font-family:sans-serif;margin:1em} table{border-collapse:collapse} td,th{border:1px solid #aaa;"
             "padding:3px 6px;vertical-align:top} .pair{display:flex;gap:1em} .pair>div{flex:1;min-width:0}"
             "pre{background:#f6f6f6;padding:6px;overflow-x:auto;font-size:12px} mark{background:#ffd27f}"
             ".near{color:#555}</style></head><body>",
             f"<h1>Similarity report: {esc(str(out))}</h1>",
             f"<p>{len(texts)} answers to {len(cells)} answer cells compared, each with minidist (every module of "
             f"the installed package, its checks included) and with every classmate's answer to the same cell "
             f"(copydetect's fingerprints of {similarity.K}-character runs, names and comments ignored, what the "
             f"release gives left out). One entry per pair: two students, or a student and minidist, with every "
             f"cell they share. <b>{len(flagged)} pairs are flagged</b> (a cell shares at least "
             f"{similarity.THRESHOLD:.0%} of an answer's code); {len(near)} near misses (from {near_miss:.0%}) are "
             f"listed below them, <b>not flagged</b>. <b>A flag asks a person to read both answers; it changes no "
             f"score.</b> Short answers and answers the lab all but dictates score high by themselves: see "
             f"docs/INTEGRITY.md.</p>"]
    numbered = list(enumerate(pairs, 1))
    for title, flag in ((f"Flagged pairs (a cell from {similarity.THRESHOLD:g})", True),
                        (f"Near misses (from {near_miss:g} to {similarity.THRESHOLD:g}): not flagged", False)):
        parts.append(f"<h2>{esc(title)}</h2>")
        rows = [(i, p) for i, p in numbered if p.flagged == flag]
        if not rows:
            parts.append("<p>None.</p>")
            continue
        parts.append("<table><tr><th>#</th><th>highest</th><th>pair</th><th>cells flagged</th>"
                     "<th>cells shared</th></tr>")
        for i, p in rows:
            n = sum(m.score >= similarity.THRESHOLD for m in p.matches)
            parts.append(f"<tr><td><a href='#p{i}'>{i}</a></td><td>{p.score:.2f}</td><td>{esc(pair_name(p))}</td>"
                         f"<td>{n}</td><td>{len(p.matches)}</td></tr>")
        parts.append("</table>")
    for i, p in numbered:
        parts += _pair_section(i, p, releases, near_miss)
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")


def _pair_section(i: int, p: similarity.Pair, releases: dict | None, near_miss: float) -> list[str]:
    esc = html.escape
    right = "minidist" if p.library else esc(p.b)
    parts = [f"<h2 id='p{i}' class='{'flag' if p.flagged else 'near'}'>{i}. {esc(p.a)} and {right}: "
             f"{p.score:.2f} ({_status(p)})</h2>",
             "<table><tr><th>lab / notebook / cell</th><th>score</th><th></th>"
             + ("<th>shared with</th><th>the lab's own solution against minidist</th>" if p.library else "")
             + "</tr>"]
    for m in p.matches:
        mark = "flagged" if m.score >= similarity.THRESHOLD else ""
        row = (f"<tr><td>{esc(m.a.lab)} / {esc(m.a.notebook)} / {esc(m.a.cell)}</td><td>{m.score:.2f}</td>"
               f"<td>{mark}</td>")
        if p.library:
            own = similarity.solution_score(m.a.lab, m.a.notebook, m.a.cell, _stub(releases, m))
            row += (f"<td>{esc(', '.join(similarity.matched_units(m)[:5]))}</td>"
                    f"<td class='own'>{'' if own is None else f'{own:.2f}'}</td>")
        parts.append(row + "</tr>")
    parts.append("</table>")
    for m in p.matches:
        if m.score < near_miss:
            continue
        context = LIBRARY_CONTEXT_LINES if p.library else -1
        parts.append(f"<h3>{esc(m.a.lab)} / {esc(m.a.notebook)} / cell {esc(m.a.cell)}: {m.score:.2f}</h3>"
                     f"<div class='pair'><div><b>{esc(m.a.who)}</b><pre>{_marked(m.a, m.slices[0])}</pre></div>"
                     f"<div><b>{right}</b><pre>{_marked(m.b, m.slices[1], context)}</pre></div></div>")
    return parts


# --------------------------------------------------------------------------- results.csv's column
def _names_used(source: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set(re.findall(r"[A-Za-z_]\w*", source))


def _names_defined(source: str) -> set[str]:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return set(re.findall(r"^(?:def|class)\s+(\w+)", source, re.M))
    names = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for n in body:
        if isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def tested_cells(notebook_path: Path) -> dict[str, set[str]]:
    """{test cell: the answer cells it calls} of one graded notebook: the answer cells (solution cells)
    that define a name the test cell uses; an answer cell graded by hand stands for itself."""
    import nbformat
    nb = nbformat.read(str(notebook_path), as_version=4)
    answer, tests = {}, {}
    for cell in nb.cells:
        meta = (cell.get("metadata") or {}).get("nbgrader") or {}
        gid = meta.get("grade_id")
        if not gid or cell.get("cell_type") != "code":
            continue
        if meta.get("solution"):
            answer[gid] = _names_defined(cell.source)
        if meta.get("grade"):
            tests[gid] = _names_used(cell.source)
    return {t: ({t} if t in answer else {a for a, names in answer.items() if names & used})
            for t, used in tests.items()}


def similarity_column(out: Path, pairs: list[similarity.Pair]) -> dict[tuple, str]:
    """{(student, lab, notebook, test cell): "score with whom (cell)"}, for the rows that have a flag: a
    cell from THRESHOLD (a near miss, or a flagged pair's cell below it, fills nothing)."""
    best: dict[tuple, tuple[float, str]] = {}          # (student, lab, notebook, answer cell) -> flag
    for m in (m for p in pairs for m in p.matches if m.score >= similarity.THRESHOLD):
        for student in ([m.a.who] if m.b.library else [m.a.who, m.b.who]):
            key = (student, m.a.lab, m.a.notebook, m.a.cell)
            if key not in best or m.score > best[key][0]:
                best[key] = (m.score, f"{m.score:.2f} with {other_name(m, student)} ({m.a.cell})")
    column = {}
    for student, lab, nb in {k[:3] for k in best}:
        path = Path(out) / "autograded" / student / lab / f"{nb}.ipynb"
        for test, calls in tested_cells(path).items():
            flags = [best[(student, lab, nb, c)] for c in calls if (student, lab, nb, c) in best]
            if flags:
                column[(student, lab, nb, test)] = max(flags)[1]
    return column


def write_column(out: Path, column: dict[tuple, str]) -> int:
    """Fill results.csv's ``similarity`` column (added where an older OUT lacks it); every other value stays
    as it was. Returns the number of rows flagged."""
    path = Path(out) / "results.csv"
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = list(reader.fieldnames or RESULT_FIELDS), list(reader)
    if "similarity" not in fields:
        fields.append("similarity")
    flagged = 0
    for row in rows:
        row["similarity"] = column.get((row["student"], row["lab"], row["notebook"], row["cell"]), "")
        flagged += bool(row["similarity"])
    tmp = path.with_name(".results.csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)
    return flagged


def report(out: Path, near_miss: float = similarity.NEAR_MISS) -> dict:
    """Compare OUT's answers and write OUT/similarity.html and results.csv's column; pairs from
    ``near_miss`` up to THRESHOLD are listed as near misses, not flagged."""
    out = Path(out)
    if not (out / "autograded").is_dir() or not (out / "results.csv").is_file():
        raise SystemExit(f"{out} is no graded batch (no autograded/ or results.csv): run `python -m autograder "
                         f"grade SUBMISSIONS --out {out}` first")
    if not 0 <= near_miss <= similarity.THRESHOLD:
        raise SystemExit(f"--near-miss {near_miss:g}: a score from 0 to the threshold {similarity.THRESHOLD:g}")
    pairs, texts, releases = similarity.find_pairs(out, near_miss)
    write_html(out / "similarity.html", pairs, texts, out, releases, near_miss)
    rows = write_column(out, similarity_column(out, pairs))
    return {"pairs": pairs, "answers": len(texts), "rows_flagged": rows, "html": out / "similarity.html",
            "near_miss": near_miss}
