"""Every lab, end to end: its solution gets full marks and its release 0 through nbgrader, and
every bug of its bank loses points on the tests it names (``selftest --quick``).

A quick selftest spends most of its wall time waiting (kernels starting, deadlock bugs running
into their timeouts), so two labs run side by side; each lab still gets its own test and report."""
import io
from concurrent.futures import ThreadPoolExecutor

import pytest

from autograder.course import all_labs
from autograder.selftest import selftest

LABS = all_labs()
SIDE_BY_SIDE = 2


def _one(lab):
    report = io.StringIO()
    return selftest(labs=[lab], jobs=2, progress=False, quick=True, stream=report), report.getvalue()


@pytest.fixture(scope="module")
def results():
    pool = ThreadPoolExecutor(SIDE_BY_SIDE)
    futures = {lab: pool.submit(_one, lab) for lab in LABS}
    yield futures
    pool.shutdown(wait=True)


def test_there_are_labs():
    assert "lab1_collectives" in LABS


@pytest.mark.parametrize("lab", LABS)
def test_lab_selftest(lab, results):
    ok, report = results[lab].result()
    assert ok, report
