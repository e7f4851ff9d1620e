"""Feedback that teaches: a bank bug's failure message names the likely cause (issue 43).

Each row takes a realistic mistake from a lab's bug bank (``solutions/<lab>/bugbank.py``), runs the
solution notebook's cells with that one cell broken, in this process, then the test cell that
must catch it, and asserts the words of the diagnosis (:mod:`minidist.checks.kit.diagnosis`):
the numbers a classic mistake leaves (a factor of the group's size, of k, rows in the wrong
order) are named, not only "differs from the reference"."""
import os
import re

import nbformat
import pytest

from autograder.course.cells import grade_id, nbg, skip_demos, strip_solution_markers
from autograder.selftest.bank import inject, load_bank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MISTAKES = [
    # (lab, bank bug, test cell, words its failure must hold)
    ("lab1_collectives", "rs_overwrites_instead_of_adding", "test_ring_reduce_scatter_correct",
     ["chunk 0 holds the sum over rank 1 only (missing the input of rank 0)",
      "a received chunk written over the running sum instead of added to it"]),
    ("lab1_collectives", "ring_missing_allgather", "test_ring_all_reduce_correct",
     ["chunk 1 holds this rank's own input only", "was the phase that brings the result back left out?"]),
    ("lab2_data_parallel", "avg_forgets_to_average", "test_average_gradients_equal",
     ["summed instead of averaged", "check the division by the world size"]),
    ("lab10_checkpointing", "load_same_layout_assumed", "test_load_resharded",
     ["rank 0's fc.weight has shape (2, 6), expected (4, 6)",
      "it is rank 0's piece of the layout the checkpoint was saved in (rows on 4 ranks)"]),
    ("lab10_checkpointing", "save_replica_by_every_rank", "test_save_sharded",
     ["some written by two ranks: a replica is written by rank 0 only"]),
    ("lab2_data_parallel", "avg_averages_twice", "test_average_gradients_equal",
     ["summed instead of averaged (or averaged twice)", "check the division by the world size"]),
    ("lab3_zero_fsdp", "rs_forgets_to_average", "test_reduce_scatter_gradients",
     ["It is N times too large: divide the sum by the world size"]),
    ("lab3_zero_fsdp", "rs_averages_twice", "test_reduce_scatter_gradients",
     ["every value is the expected one divided by 2", "an average taken twice"]),
    ("lab4_pipeline", "executor_no_loss_scaling", "test_run_pipeline_gradients",
     ["every value is the expected one times 2", "the loss of each micro-batch must be scaled by 1/m"]),
    ("lab4_pipeline", "executor_zero_grad_per_microbatch", "test_run_pipeline_gradients",
     ["are gradients of some micro-batches lost (overwritten, or .grad zeroed between micro-batches)?"]),
    ("lab5_tensor_parallel", "g_averages", "test_reduce_from_tp",
     ["the output differs from one process", "divided by 2 = t, the tensor-parallel group's size"]),
    ("lab5_tensor_parallel", "f_all_reduces_forward", "test_copy_to_tp",
     ["the output differs from one process", "times 2 = t, the tensor-parallel group's size"]),
    ("lab6_context_parallel", "ulysses_missing_scale", "test_ulysses_attention",
     ["the output differs from the reference", "it equals attention without the 1/√d scale"]),
    ("lab6_context_parallel", "zigzag_pairs_r_and_r_plus_p", "test_zigzag_shard",
     ["your shard holds chunks 0 and 2 of the 2P = 4", "rank r holds chunks r and 2P−1−r (here 0 and 3)"]),
    ("lab7_3d_parallel", "grads_not_divided_by_dp", "test_train_step_3d",
     ["step 0 matched", "these are one process's losses with every gradient times 2 = d", "a sum not divided by d"]),
    ("lab7_3d_parallel", "loss_scaled_by_m_twice", "test_train_step_3d",
     ["loss at step 0 is", "every value is the expected one divided by 2 = d = p = t = m"]),
    ("lab8_memory", "mixed_sum_not_mean", "test_mixed_precision_step",
     ["the step they took (after - before)", "times 2 = t, the group's size"]),
    ("lab8_memory", "recompute_rng_not_replayed", "test_recompute_blocks",
     ["x.grad differs from the reference", "the recomputed forward drew other dropout masks than the first"]),
    ("lab9_expert_parallel", "loss_fraction_not_divided_by_k", "test_load_balancing_loss",
     ["the loss differs from the reference", "times 2 = k"]),
    ("lab9_expert_parallel", "loss_missing_num_experts_factor", "test_load_balancing_loss",
     ["divided by 4 = E, the number of experts"]),
    ("lab8_memory", "scaler_agrees_over_the_world", "test_DynamicLossScaler",         # visible since issue 43
     ["expected False (a non-finite gradient on no rank of this group)", "all-reduced over the whole world"]),
    ("lab9_expert_parallel", "router_token_major_queue", "test_top_k_router",       # visible since issue 43
     ["top_k_router (n=10, E=4, k=2, capacity=1.0", "first choices first", "your queue takes each token's choices"]),
    ("lab2_data_parallel", "buckets_cap_off_by_one", "test_make_buckets",                # visible since issue 43
     ["cap_bytes=728", "exactly cap_bytes still fits"]),
    ("lab2_data_parallel", "buckets_assume_fp32", "test_make_buckets",                   # visible since issue 43
     ["(bfloat16), cap_bytes=400", "a parameter's size in bytes is p.numel() * p.element_size()"]),
    ("lab5_tensor_parallel", "attn_checks_query_heads_only", "test_tp_attention",        # visible since issue 43
     ["12 query and 6 key/value heads do not both split over t = 4", "a ValueError"]),
    ("lab9_expert_parallel", "dispatch_rows_left_in_source_order", "test_ep_dispatch",
     ["expert_inputs differs from one process", "the right rows in the wrong order"]),
    ("lab11_overlap", "ag_waits_before_matmul", "test_all_gather_matmul",
     ["step 0's send was waited for before the matmul of step 0", "nothing overlapped"]),
    ("lab11_overlap", "prefetch_everything_upfront", "test_prefetch_forward",
     ["unit 2's all-gather was posted before unit 0 finished", "three units' full weights are held at once"]),
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


def test_feedback_quotes_no_hidden_line_when_a_test_cell_timed_out():
    """nbclient's timeout error previews the cell's source: the feedback keeps the error's name and
    the shown part of its message, never a hidden test's line."""
    from nbformat.v4 import new_code_cell

    from autograder.grading.worker.nbext import hiding
    shown = "checks.check_allsum(allsum)"
    full = shown + "\n### BEGIN HIDDEN TESTS\nchecks.check_allsum(allsum, hidden=True)\n### END HIDDEN TESTS"
    cell = new_code_cell(full, metadata={"nbgrader": {"grade_id": "test_allsum", "grade": True, "points": 2}})
    cell.outputs = [nbformat.v4.new_output("error", ename="CellTimeoutError", traceback=["frame", full],
                                           evalue=f"A cell timed out after 20 seconds.\nHere is a preview "
                                                  f"of the cell contents:\n-------------------\n{full}\n"),
                    nbformat.v4.new_output("stream", name="stdout", text=f"ran {full.splitlines()[2]}\nok\n")]
    out, _ = hiding({"test_allsum": shown})().preprocess_cell(cell, {}, 0)
    said = out.source + "".join(str(o) for o in out.outputs)
    assert "hidden=True" not in said and "A cell timed out after 20 seconds." in said, said
    assert out.outputs[0].traceback == [f"CellTimeoutError: {out.outputs[0].evalue}"] and "ok" in said
