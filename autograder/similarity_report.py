"""What ``python -m autograder similarity OUT`` writes: ``similarity.html`` and ``results.csv``'s column.

The pairs come from :mod:`autograder.similarity`. ``similarity.html`` lists every flagged pair, highest
score first, the two texts side by side with the shared code marked (of the library's modules, only
the lines around what is shared); every name and every line of code is escaped. ``results.csv`` gets
one column, ``similarity``: for a test's row, the highest flagged score among the answer cells that
test calls (the cells defining a name the test cell uses) and with whom, or nothing. No other column
and no other file changes: a flag asks a person to read two answers, it is no verdict.
"""
from __future__ import annotations

import ast
import csv
import html
import os
import re
from pathlib import Path

from autograder import similarity
from autograder.report import RESULT_FIELDS

#: lines of context kept around the shared code of the library's modules (they are long)
LIBRARY_CONTEXT_LINES = 3


def other_name(pair: similarity.Pair, student: str | None = None) -> str:
    """Who the answer of ``student`` (default: the pair's first) resembles: a classmate, or the library's
    functions that hold the shared code."""
    if pair.b.library:
        units = similarity.matched_units(pair)
        return "minidist (" + ", ".join(units[:3]) + ")" if units else "minidist"
    return pair.a.who if student == pair.b.who else pair.b.who


def _marked(text: similarity.Text, slices, context: int = -1) -> str:
    from copydetect.utils import highlight_overlap
    import numpy as np
    spans = np.asarray(slices, dtype=int).reshape(2, -1) if len(slices) else np.zeros((2, 0), dtype=int)
    if spans.shape[1] == 0:
        return html.escape(text.source)
    order = np.argsort(spans[0])
    marked, _ = highlight_overlap(text.source, spans[:, order], "<mark>", "</mark>", truncate=context,
                                  escape_html=True)
    return marked


def write_html(path: Path, pairs: list[similarity.Pair], texts: list[similarity.Text], out: Path,
               releases: dict | None = None) -> None:
    esc = html.escape
    cells = {(t.lab, t.notebook, t.cell) for t in texts}
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>Similarity report</title><style>"
             "body{font-family:sans-serif;margin:1em} table{border-collapse:collapse} td,th{border:1px solid #aaa;"
             "padding:3px 6px;vertical-align:top} .pair{display:flex;gap:1em} .pair>div{flex:1;min-width:0}"
             "pre{background:#f6f6f6;padding:6px;overflow-x:auto;font-size:12px} mark{background:#ffd27f}"
             "</style></head><body>",
             f"<h1>Similarity report: {esc(str(out))}</h1>",
             f"<p>{len(texts)} answers to {len(cells)} answer cells compared, each with the library's answer "
             f"(the minidist modules its lab refuses) and with every classmate's answer to the same cell. "
             f"{len(pairs)} pairs share at least {similarity.THRESHOLD:.0%} of an answer's code "
             f"(copydetect's fingerprints of {similarity.K}-character runs, names and comments ignored, what the "
             f"release gives left out). <b>A flag asks a person to read both answers; it changes no score.</b> "
             f"Short answers and answers the lab all but dictates score high by themselves: see docs/INTEGRITY.md.</p>"]
    if not pairs:
        parts.append("<p>No pair is flagged.</p>")
    else:
        parts.append("<table><tr><th>#</th><th>score</th><th>lab / cell</th><th>student</th><th>resembles</th></tr>")
        for i, p in enumerate(pairs, 1):
            parts.append(f"<tr><td><a href='#p{i}'>{i}</a></td><td>{p.score:.2f}</td>"
                         f"<td>{esc(p.a.lab)} / {esc(p.a.cell)}</td><td>{esc(p.a.who)}</td>"
                         f"<td>{esc(other_name(p))}</td></tr>")
        parts.append("</table>")
    for i, p in enumerate(pairs, 1):
        right = "minidist's own implementation" if p.b.library else f"{esc(p.b.who)}"
        parts.append(f"<h2 id='p{i}'>{i}. {p.score:.2f}: {esc(p.a.who)} and {right}, "
                     f"{esc(p.a.lab)} / {esc(p.a.notebook)} / cell {esc(p.a.cell)}</h2>")
        if p.b.library:
            stub = (releases or {}).get((p.a.lab, p.a.notebook), {}).get(p.a.cell, "")
            own = similarity.solution_score(p.a.lab, p.a.notebook, p.a.cell, p.b, stub)
            parts.append(f"<p>Shared with {esc(', '.join(similarity.matched_units(p)) or 'minidist')}."
                         + (f" The lab's own solution to this cell scores {own:.2f} against the library."
                            if own is not None else "") + "</p>")
        context = LIBRARY_CONTEXT_LINES if p.b.library else -1
        parts.append(f"<div class='pair'><div><b>{esc(p.a.who)}</b><pre>{_marked(p.a, p.slices[0])}</pre></div>"
                     f"<div><b>{right}</b><pre>{_marked(p.b, p.slices[1], context)}</pre></div></div>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")


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
    """{(student, lab, notebook, test cell): "score with whom (cell)"}, for the rows that have a flag."""
    best: dict[tuple, tuple[float, str]] = {}          # (student, lab, notebook, answer cell) -> flag
    for p in pairs:
        for student in ([p.a.who] if p.b.library else [p.a.who, p.b.who]):
            key = (student, p.a.lab, p.a.notebook, p.a.cell)
            if key not in best or p.score > best[key][0]:
                best[key] = (p.score, f"{p.score:.2f} with {other_name(p, student)} ({p.a.cell})")
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


def report(out: Path) -> dict:
    """Compare OUT's answers and write OUT/similarity.html and results.csv's column."""
    out = Path(out)
    if not (out / "autograded").is_dir() or not (out / "results.csv").is_file():
        raise SystemExit(f"{out} is no graded batch (no autograded/ or results.csv): run `python -m autograder "
                         f"grade SUBMISSIONS --out {out}` first")
    pairs, texts, releases = similarity.find_pairs(out)
    write_html(out / "similarity.html", pairs, texts, out, releases)
    rows = write_column(out, similarity_column(out, pairs))
    return {"pairs": pairs, "answers": len(texts), "rows_flagged": rows, "html": out / "similarity.html"}
