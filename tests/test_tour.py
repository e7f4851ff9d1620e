"""`minidist tour`: a line per row as it finishes (at most 100 columns, colour only at a
terminal), grouped by lecture, a summary; `--json`: every row says whether it passed and with
which tolerance."""
import io
import json
import math

import pytest

from minidist.cli import main
from minidist.tour import judge


def test_a_row_passes_only_within_its_tolerance():
    assert judge({"max_err": 1e-7}, 1e-5) == {"max_err": 1e-7, "tolerance": 1e-5, "passed": True}
    assert not judge({"max_err": 1e-3}, 1e-5)["passed"]
    assert not judge({"max_err": math.nan}, 1e-5)["passed"]
    assert not judge({"max_err": None}, 1e-5)["passed"]                   # no comparison made: not a pass
    assert not judge({"max_err": 0.0, "passed": False}, 1e-5)["passed"]    # the module's own check failed
    assert judge({"max_err": 1e-3, "tolerance": 1e-2}, 1e-5)["tolerance"] == 1e-2


def test_tour_json_rows_carry_passed_and_tolerance(capsys):
    assert main(["tour", "--json", "--only", "all-reduce: ring"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["passed"] is True and r["tolerance"] == 1e-5 for r in rows), rows
    assert all(r["max_err"] <= r["tolerance"] for r in rows)


def _row(**kw):
    return {"technique": "all-reduce: ring", "passed": True, "max_err": 9.5e-7, "tolerance": 1e-5,
            "bytes_per_rank": 393216, "bytes_theory": 393216, "time_s": 0.21, "note": "why it passed"} | kw


def test_a_line_fits_100_columns_and_colours_only_on_request():
    from minidist.tour import detail_lines, header, row_line, summary_line
    long = _row(technique="CP causal ring attention, zigzag shards over many many ranks", passed=False,
                max_err=float("nan"), bytes_per_rank=None, time_s=123.456)
    for row in (_row(), long):
        for total in (6, 35, 120):
            assert len(row_line(row, total - 1, total)) <= 100 and len(header(total)) <= 100
    assert row_line(_row(), 2, 35).startswith("[ 3/35] ✓ all-reduce: ring")
    assert "384 KiB / 384 KiB" in row_line(_row(), 2, 35) and row_line(_row(), 2, 35).endswith("0.21 s")
    assert "\033[" not in row_line(long, 0, 35) and "\033[31m✗\033[0m" in row_line(long, 0, 35, colour=True)
    assert detail_lines(_row(), verbose=False) == [] and detail_lines(_row(), verbose=True)[0].strip() == "why it passed"
    assert detail_lines(long, verbose=False)            # a failed row always says why
    assert summary_line([_row(), long], 19.24) == f"1/2 passed in 19.2 s; failed: {long['technique']}"


def test_colour_only_at_a_terminal_without_no_color(monkeypatch):
    from minidist.tour import use_colour

    class Terminal:
        def isatty(self):
            return True
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_colour(Terminal())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(Terminal())
    monkeypatch.delenv("NO_COLOR")
    assert not use_colour(io.StringIO())


def test_tour_prints_a_line_per_row_under_its_lecture_and_a_summary(capsys):
    assert main(["tour", "--only", "all-reduce: fast_ring"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Lecture 1: collectives from send/recv" and "error / tolerance" in lines[1]
    assert lines[2].startswith("[1/1] ✓ all-reduce: fast_ring") and "\033[" not in lines[2]   # not a terminal
    assert lines[-1].startswith("1/1 passed in ") and lines[-1].endswith(" s")
    assert all(len(line) <= 100 for line in lines)


def test_only_matching_nothing_is_a_usage_error_naming_the_techniques(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["tour", "--only", "no such technique"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("minidist tour: error: --only 'no such technique' matches no technique")
    assert "all-reduce: ring" in err and "zero1" in err
