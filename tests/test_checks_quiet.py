"""A passing lab check writes nothing to stderr (nbgrader would score the cell 0)."""
import sys
import warnings

import pytest

from minidist.checks import lab4_pipeline
from minidist.checks.kit.quiet import passes_quietly
from minidist.pipeline import make


def test_warnings_and_stderr_of_a_passing_check_go_to_stdout(capsys):
    @passes_quietly
    def check():
        warnings.warn("TypedStorage is deprecated", UserWarning)
        print("from the student's code", file=sys.stderr)
        return 42

    assert check() == 42
    out, err = capsys.readouterr()
    assert err == ""
    assert "TypedStorage is deprecated" in out and "from the student's code" in out
    assert warnings.showwarning is not None and sys.stderr is not sys.stdout     # both restored


def test_a_failing_check_still_raises(capsys):
    @passes_quietly
    def check():
        raise AssertionError("wrong")

    with pytest.raises(AssertionError, match="wrong"):
        check()


def test_a_real_check_whose_student_code_warns_passes_quietly(capsys):
    built = {(p, m): make("gpipe", p, m) for p, m in lab4_pipeline.cases.SCHEDULE_CASES}   # outside the refusal

    def gpipe_schedule(p, m):
        warnings.warn("a student's leftover warning")
        return built[p, m]

    lab4_pipeline.check_gpipe_schedule(gpipe_schedule)
    out, err = capsys.readouterr()
    assert err == "" and "leftover warning" in out
