"""``python -m autograder similarity OUT``: after ``grade``, the answers that look copied, by pair."""
from __future__ import annotations

from pathlib import Path

from autograder.cli.common import table


def add(sub) -> None:
    s = sub.add_parser("similarity", help="after grade: compare every answer cell of OUT with all of the installed "
                                          "minidist (its checks included) and with classmates', by pair "
                                          "(OUT/similarity.html, results.csv's similarity)")
    s.add_argument("out")
    s.add_argument("--near-miss", type=float, default=None, metavar="SCORE",
                   help="list the pairs from SCORE up to the threshold (0.8) below the flagged ones, not flagged "
                        "(default 0.6)")
    s.set_defaults(fn=run)


def run(a) -> int:
    from autograder.reports.similarity import NEAR_MISS, THRESHOLD
    from autograder.reports.similarity_report import pair_name, report
    r = report(Path(a.out), NEAR_MISS if a.near_miss is None else a.near_miss)
    top = [{"highest": f"{p.score:.2f}", "pair": pair_name(p)[:60],
            "cells": ", ".join(f"{m.a.cell} {m.score:.2f}" for m in p.matches[:4])
                     + (f", +{len(p.matches) - 4}" if len(p.matches) > 4 else ""),
            "": "flagged" if p.flagged else "near miss, not flagged"} for p in r["pairs"][:20]]
    if top:
        print(table(top, ["highest", "pair", "cells", ""]))
        if len(r["pairs"]) > len(top):
            print(f"... and {len(r['pairs']) - len(top)} more")
    flagged = sum(p.flagged for p in r["pairs"])
    print(f"\n{r['answers']} answers compared; pairs flagged (a cell at or above {THRESHOLD:g}): {flagged}; "
          f"near misses from {r['near_miss']:g}, not flagged: {len(r['pairs']) - flagged} "
          f"(flags for a person to read; no score changed)\n"
          f"report:  {r['html']}\nresults: {Path(a.out) / 'results.csv'} ({r['rows_flagged']} rows with a similarity)")
    return 0
