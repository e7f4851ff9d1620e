"""What the ``minidist`` command prints: tables, JSON, wrapped prose, help for a terminal.

Standard library only: ``minidist --help`` must not wait for torch.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import textwrap

MAX_WIDTH = 100


def width() -> int:
    """The terminal's width, at most MAX_WIDTH (80 when stdout is not a terminal)."""
    return min(MAX_WIDTH, shutil.get_terminal_size((80, 24)).columns)


def wrap(text: str, hanging: str = "  ") -> str:
    """Each line of ``text`` wrapped at the terminal width, continuation lines indented by
    ``hanging`` (blank lines kept)."""
    return "\n".join(textwrap.fill(line, width(), subsequent_indent=hanging, break_on_hyphens=False) if line.strip() else ""
                     for line in text.splitlines())


def plain(text: str) -> str:
    """Docstring markup for a terminal: ``x`` and :func:`~a.b.x` become x; a line wider than
    the terminal is wrapped (the others keep their breaks: lists stay lists)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text).replace("``", "")
    return "\n".join(textwrap.fill(line, width(), break_on_hyphens=False) if len(line) > width() else line
                     for line in text.splitlines())


def format_table(rows: list[dict]) -> str:
    """Rows of dicts as an aligned text table (numbers in a compact, readable form)."""
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            if v == 0 or math.isnan(v):
                return f"{v:g}"
            return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:.3f}".rstrip("0").rstrip(".")
        return str(v)

    table = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()    # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in table])


def emit(rows, as_json: bool) -> None:
    print(json.dumps(rows, indent=2, default=str) if as_json else format_table(rows))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option; descriptions and examples kept as written; at most
    MAX_WIDTH columns."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog, width=width(), max_help_position=30, **kwargs)

    def add_argument(self, action):
        # An option given without help still shows its default (argparse prints nothing for it).
        if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        super().add_argument(action)

    def _get_help_string(self, action):
        # A flag's default (False) and an unset optional value (None) say nothing worth a line.
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)
