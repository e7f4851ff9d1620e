"""Every lab, end to end: its solution gets full marks through nbgrader (sandbox and
confirmation on), its release 0, every bug of its bank loses points on the tests it names, and
every correct alternative gets full marks (``selftest --quick``).

One lab at a time, the longest first; each lab gets its own test and report. Two labs side by
side took no less time on 2 cores (431 s one at a time, 433-443 s side by side) and raised the
load average to 24-46, where the short launch timeouts of the bank's kernels timed out correct
alternatives' memory launches twice in a row, and once both labs' solutions ran past nbgrader's
600 s wall-clock limit."""
import io
from concurrent.futures import ThreadPoolExecutor

import pytest

from autograder.course import all_labs
from autograder.selftest import selftest

LABS = all_labs()
SIDE_BY_SIDE = 1
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
