"""Every lab, end to end: its solution gets full marks and its release 0 through nbgrader, and
every bug of its bank loses points on the tests it names (``selftest --quick``)."""
import pytest

from autograder.course import all_labs
from autograder.selftest import selftest

LABS = all_labs()


def test_there_are_labs():
    assert "lab1_collectives" in LABS


@pytest.mark.parametrize("lab", LABS)
def test_lab_selftest(lab, capsys):
    ok = selftest(labs=[lab], jobs=2, progress=False, quick=True)
    report = capsys.readouterr().out
    assert ok, report
