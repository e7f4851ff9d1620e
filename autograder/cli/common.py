"""What several commands share: a plain-text table, the time-limit options of ``grade`` and
``selftest``, and a platform bundle's ``--check``."""
from __future__ import annotations

from pathlib import Path


def table(rows: list[dict], cols: list[str]) -> str:
    w = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(w[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def add_timing(s) -> None:
    """The per-cell and per-submission time limits, and the progress bar."""
    s.add_argument("--cell-timeout", type=int, default=None,
                   help="seconds per cell (default: Execute.timeout in nbgrader_config.py)")
    s.add_argument("--wall-timeout", type=float, default=None,
                   help="wall-clock seconds per submission (default: 600)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")


def bundle_check(a) -> int:
    """``gradescope|prairielearn LAB --check ZIP|DIR``: has the course changed since that bundle was built?"""
    from autograder.handout.platforms.version import check
    ok, text = check(a.lab, Path(a.check))
    print(text)
    return 0 if ok else 1
