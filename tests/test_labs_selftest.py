"""Every lab, end to end: its solution gets full marks through nbgrader (sandbox and
confirmation on), its release 0, every bug of its bank loses points on the tests it names, and
every correct alternative gets full marks (``selftest --quick``).

One lab per test, one at a time. Two labs side by side took no less time on 2 cores (431 s one
at a time, 433-443 s side by side) and raised the load average to 24-46, where the short launch
timeouts of the bank's kernels timed out correct alternatives' memory launches twice in a row,
and once both labs' solutions ran past nbgrader's 600 s wall-clock limit."""
import io

import pytest

from autograder.course.labs import all_labs
from autograder.selftest.selftest import selftest

# the course's content, not the grader's code: `make test-course` (`.ci/run` runs it after `make test`)
pytestmark = pytest.mark.course

LABS = all_labs()


def test_there_are_labs():
    assert "lab1_collectives" in LABS


@pytest.mark.parametrize("lab", LABS)
def test_lab_selftest(lab):
    report = io.StringIO()
    ok = selftest(labs=[lab], jobs=2, progress=False, quick=True, stream=report)
    assert ok, report.getvalue()
