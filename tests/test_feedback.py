"""Feedback that teaches: a bank bug's failure message names the likely cause (issue 43).

Each row takes a realistic mistake from a lab's bug bank (``autograder/bugbank``), runs the
solution notebook's cells with that one cell broken, in this process, then the test cell that
must catch it, and asserts the words of the diagnosis (:mod:`minidist.checks.kit.diagnosis`):
the numbers a classic mistake leaves (a factor of the group's size, of k, rows in the wrong
order) are named, not only "differs from the reference"."""
import os
import re

import nbformat
import pytest

from autograder.course import grade_id, nbg, strip_solution_markers
from autograder.notebooks import skip_demos
from autograder.selftest import inject, load_bank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MISTAKES = [
    # (lab, bank bug, test cell, words its failure must hold)
    ("lab2_data_parallel", "avg_forgets_to_average", "test_average_gradients_equal",
     ["summed instead of averaged", "check the division by the world size"]),
    ("lab3_zero_fsdp", "rs_forgets_to_average", "test_reduce_scatter_gradients",
     ["It is N times too large: divide the sum by the world size"]),
    ("lab5_tensor_parallel", "g_averages", "test_reduce_from_tp",
     ["the output differs from one process", "divided by 2 = t, the tensor-parallel group's size"]),
    ("lab5_tensor_parallel", "f_all_reduces_forward", "test_copy_to_tp",
     ["the output differs from one process", "times 2 = t, the tensor-parallel group's size"]),
    ("lab8_memory", "mixed_sum_not_mean", "test_mixed_precision_step",
     ["the step they took (after - before)", "times 2 = t, the group's size"]),
    ("lab9_expert_parallel", "loss_fraction_not_divided_by_k", "test_load_balancing_loss",
     ["the loss differs from the reference", "times 2 = k"]),
    ("lab9_expert_parallel", "loss_missing_num_experts_factor", "test_load_balancing_loss",
     ["divided by 4 = E, the number of experts"]),
    ("lab8_memory", "scaler_agrees_over_the_world", "test_DynamicLossScaler",         # visible since issue 43
     ["expected False (a non-finite gradient on no rank of this group)", "all-reduced over the whole world"]),
    ("lab9_expert_parallel", "router_token_major_queue", "test_top_k_router",       # visible since issue 43
     ["top_k_router (n=10, E=4, k=2, capacity=1.0", "first choices first", "your queue takes each token's choices"]),
    ("lab9_expert_parallel", "dispatch_rows_left_in_source_order", "test_ep_dispatch",
     ["expert_inputs differs from one process", "the right rows in the wrong order"]),
]


def failure_of(lab: str, bug_name: str, test_id: str) -> str:
    """The AssertionError the visible part of test cell ``test_id`` raises on the solution with
    ``bug_name`` injected."""
    bug = next(b for b in load_bank(lab)["BUGS"] if b["name"] == bug_name)
    nb = nbformat.read(os.path.join(ROOT, "solutions", lab, f"{lab}.ipynb"), as_version=4)
    nb = skip_demos(inject(bug, {lab: nb})[lab])
    namespace = {"__name__": "__main__"}
    for cell in nb.cells:
        if cell.cell_type != "code" or (nbg(cell).get("grade") and not nbg(cell).get("solution")):
            continue            # test cells: only the one asked for runs, below
        exec(compile(strip_solution_markers(cell.source), f"<solution {grade_id(cell)}>", "exec"), namespace)
    test = next(c for c in nb.cells if grade_id(c) == test_id).source
    visible = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", test, flags=re.S)   # as students see it
    with pytest.raises(AssertionError) as info:
        exec(compile(visible, f"<grader {test_id}>", "exec"), namespace)
    return str(info.value)


@pytest.mark.parametrize("lab, bug, test, words", MISTAKES, ids=[m[1] for m in MISTAKES])
def test_a_classic_mistake_is_diagnosed_in_its_failure(lab, bug, test, words):
    message = failure_of(lab, bug, test)
    for word in words:
        assert word in message, message
