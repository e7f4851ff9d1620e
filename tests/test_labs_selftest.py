"""Every lab, end to end: its solution gets full marks through nbgrader (sandbox and
confirmation on), its release 0, every bug of its bank loses points on the tests it names, and
every correct alternative gets full marks (``selftest --quick``).

A quick selftest spends most of its wall time waiting (kernels starting, deadlock bugs running
into their timeouts), so two labs run side by side, the longest first; each lab still gets its
own test and report. The extra load is what a class's grading batch meets too: the confirmation
retries a test it could not confirm with longer timeouts, and the bank's kernels re-run a test
the solution or an alternative failed once."""
import io
from concurrent.futures import ThreadPoolExecutor

import pytest

from autograder.course import all_labs
from autograder.selftest import selftest

LABS = all_labs()
SIDE_BY_SIDE = 2
LONGEST_FIRST = ["lab5_tensor_parallel", "lab1_collectives", "lab2_data_parallel", "lab3_zero_fsdp"]


def _one(lab):
    report = io.StringIO()
    return selftest(labs=[lab], jobs=2, progress=False, quick=True, stream=report), report.getvalue()


@pytest.fixture(scope="module")
def results():
    pool = ThreadPoolExecutor(SIDE_BY_SIDE)
    order = sorted(LABS, key=lambda lab: LONGEST_FIRST.index(lab) if lab in LONGEST_FIRST else len(LONGEST_FIRST))
    futures = {lab: pool.submit(_one, lab) for lab in order}
    yield futures
    pool.shutdown(wait=True)


def test_there_are_labs():
    assert "lab1_collectives" in LABS


@pytest.mark.parametrize("lab", LABS)
def test_lab_selftest(lab, results):
    ok, report = results[lab].result()
    assert ok, report
