"""``minidist tour``: a line per technique as it finishes, grouped by lecture, then a summary.

The rows themselves, and how a line reads, are :mod:`minidist.tour`'s; this module only
decides what goes to the terminal (``--json``: the rows alone, as before).
"""
from __future__ import annotations

import json
import sys
import time

DESCRIPTION = """\
Run every technique of the course on CPU ranks (4; the 3D row on 8) against a single-process
reference: each line says whether it passed, its error against the tolerance, the bytes each
rank sent against the formula, and the time it took."""

EPILOG = """\
examples:
  minidist tour
  minidist tour --only ring --verbose
  minidist tour --json > tour.json"""


def add_arguments(p) -> None:
    p.add_argument("--only", metavar="TEXT", help="run only the techniques whose name contains TEXT")
    p.add_argument("--verbose", "-v", action="store_true", help="each technique's note under its line")
    p.add_argument("--json", action="store_true", help="the rows as JSON, nothing else on stdout")


def run(args, error) -> int:
    from minidist.tour import (LECTURES, detail_lines, entries, header, row_line, run_tour, summary_line,
                               use_colour)
    selected = entries(args.only)
    if not selected:
        names = ", ".join(entry.name for _, entry in entries())
        error(f"--only {args.only!r} matches no technique; the techniques are: {names}")
    if args.json:
        rows = run_tour(selected=selected)
        print(json.dumps(rows, indent=2, default=str))
        return 0 if all(r["passed"] for r in rows) else 1

    colour = use_colour(sys.stdout)
    seen = set()

    def show(row, index, total, module):
        if module not in seen:
            seen.add(module)
            print(("\n" if index else "") + LECTURES.get(module, module))
            print(header(total))
        print(row_line(row, index, total, colour))
        for line in detail_lines(row, args.verbose):
            print(line)
        sys.stdout.flush()          # each line as its row finishes, also through a pipe

    start = time.perf_counter()
    rows = run_tour(selected=selected, on_row=show)
    print()
    print(summary_line(rows, time.perf_counter() - start))
    return 0 if all(r["passed"] for r in rows) else 1
