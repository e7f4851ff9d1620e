"""`minidist tour --json`: every row says whether it passed and with which tolerance."""
import json
import math

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
