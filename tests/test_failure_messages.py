"""What a failing test cell shows a student (issue 60): the case and the student's line first, and no
frame of the checks (``minidist/checks/``) or the grader (``autograder/``) above it.

Each lab's row runs its solution notebook's cells in this process with one graded function replaced by
one whose slice is one short (it raises IndexError), runs the visible part of that function's test
cell, and reads the exception as the notebook shows it (IPython's ``_render_traceback_`` hook, which
:mod:`minidist.checks.kit.failure` sets). The kit-level rows (``make test``) do the same for a check
made here and one on launched ranks.
"""
import re

import pytest
import torch

from autograder.course.cells import grade_id, nbg, skip_demos, strip_solution_markers
from minidist.checks.kit.check import Registry
from test_device_check import ROOT, _scaled, _times_two, _times_two_on_every_rank, compile_cell

LABS = [
    # (lab, graded function, its test cell)
    ("lab1_collectives", "ring_all_reduce", "test_ring_all_reduce_correct"),
    ("lab2_data_parallel", "average_gradients", "test_average_gradients_equal"),
    ("lab3_zero_fsdp", "reduce_scatter_gradients", "test_reduce_scatter_gradients"),
    ("lab4_pipeline", "gpipe_schedule", "test_gpipe_schedule"),
    ("lab5_tensor_parallel", "vocab_parallel_cross_entropy", "test_vocab_parallel_cross_entropy"),
    ("lab6_context_parallel", "all_to_all", "test_all_to_all"),
    ("lab7_3d_parallel", "mesh_groups", "test_mesh_groups"),
    ("lab8_memory", "zero1_mixed_precision_step", "test_zero1_mixed_precision_step"),
    ("lab9_expert_parallel", "ep_combine", "test_ep_combine"),
    ("lab10_checkpointing", "latest_checkpoint", "test_latest_checkpoint"),
]
BROKEN = '''
def {name}(*args, **kwargs):
    kept = list(args)[:-1]
    return kept[len(args) - 1]
'''
STUDENT_LINE = "return kept[len(args) - 1]"


def shown(err: BaseException) -> str:
    """``err`` as a notebook shows it (IPython's showtraceback: the exception's own rendering if it has one)."""
    if hasattr(err, "_render_traceback_"):
        return "\n".join(err._render_traceback_())
    from IPython.core.ultratb import FormattedTB
    return "\n".join(FormattedTB(mode="Context", theme_name="nocolor").structured_traceback(
        type(err), err, err.__traceback__))


def failing_cell(namespace: dict, test_source: str, test_id: str) -> BaseException:
    visible = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", test_source, flags=re.S)
    try:
        exec(compile_cell(visible, f"<grader {test_id}>"), namespace)
    except Exception as err:        # noqa: BLE001  what the test cell raised is what is asserted
        return err
    raise AssertionError(f"{test_id} passed")


def assert_student_first(err: BaseException, name: str, call: str) -> None:
    """The message starts with the case and names the student's line; the notebook shows the test cell's
    ``call``, then the message, and no frame of the checks or the grader."""
    message, notebook = str(err), shown(err)
    assert message.startswith(f"{name} ("), message                   # the case comes first
    assert STUDENT_LINE in message and 'notebook cell "' in message, message   # then the student's line
    assert "minidist/checks" not in notebook and "autograder/" not in notebook, notebook
    assert 0 <= notebook.find(call) < notebook.find(message.splitlines()[0]), notebook


@pytest.mark.parametrize("lab, name, test_id", [pytest.param(*row, id=row[0], marks=pytest.mark.course) for row in LABS])
def test_a_failing_check_leads_with_the_case_and_the_students_line(lab, name, test_id):
    import nbformat
    nb = nbformat.read(f"{ROOT}/solutions/{lab}/{lab}.ipynb", as_version=4)
    namespace = {"__name__": "__main__"}
    for cell in skip_demos(nb).cells:
        if cell.cell_type == "code" and not (nbg(cell).get("grade") and not nbg(cell).get("solution")):
            exec(compile_cell(strip_solution_markers(cell.source), f"<solution {grade_id(cell)}>"), namespace)
    exec(compile_cell(BROKEN.format(name=name), "<cell broken>"), namespace)
    test = next(c for c in nb.cells if grade_id(c) == test_id).source
    assert_student_first(failing_cell(namespace, test, test_id), name, test.strip().splitlines()[0])


REGISTRY = Registry(__name__)
HERE = REGISTRY.check("double", lambda hidden: [1, 3], lambda fn, case: _scaled(fn, case), _times_two,
                      function="double")
ON_RANKS = REGISTRY.check("double_on_ranks", lambda hidden: [2], _scaled, _times_two_on_every_rank,
                          where="launch", world=lambda case: 2, timeout=60.0, function="double")


@REGISTRY.entry(HERE)
def check_double(fn, *, hidden=False) -> None:
    """A check made here."""


@REGISTRY.entry(ON_RANKS)
def check_double_on_ranks(fn, *, hidden=False) -> None:
    """A check on launched ranks."""


@pytest.mark.parametrize("check", [check_double, check_double_on_ranks], ids=["here", "launched"])
def test_the_kit_shows_the_case_and_the_students_line_and_none_of_its_frames(check):
    namespace = {"torch": torch, check.__name__: check}
    exec(compile_cell(BROKEN.format(name="double"), "<cell broken>"), namespace)
    err = failing_cell(namespace, f"{check.__name__}(double)\n", "test_double")
    assert_student_first(err, "double", f"{check.__name__}(double)")
    assert "ranks 0-1 raised: IndexError" in str(err) or check is check_double, str(err)
