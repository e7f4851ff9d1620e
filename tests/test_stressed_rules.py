"""Every rule a lab's text stresses has a visible case that breaks when the rule is broken (issue 60).

A student who passes every visible test cell must not find out from the grade that a rule the lab
stresses in bold was never tried. Each row names a rule (a phrase the lab's text sets in bold), the
bank's bug that breaks it, and the test cell whose *visible* part must fail on that bug: the row runs
the solution notebook with the bug injected, then that cell without its hidden tests
(``tests/test_device_check.py``'s ``device_cell``). The fast test checks the table against the labs'
text and banks; the rows that run notebooks belong to the course's stage (``make test-course``).
"""
import os
import re

import nbformat
import pytest

from autograder.course.cells import grade_id, nbg, skip_demos, strip_solution_markers
from autograder.selftest.bank import inject, load_bank
from test_device_check import ROOT, compile_cell

RULES = {
    # lab: [(the phrase the lab's text stresses, the bank's bug that breaks it, the test cell that should
    #        fail first; another of the bug's catches failing visibly will do)]
    "lab1_collectives": [
        ("returns a new tensor", "broadcast_receives_into_input", "test_broadcast_correct"),
        ("Break the symmetry.", "sendrecv_blocking_send_first", "test_ring_reduce_scatter_correct"),
        ("overwrites", "rs_overwrites_instead_of_adding", "test_ring_reduce_scatter_correct"),
        ("Recursive halving", "halving_uses_own_ring", "test_recursive_halving_all_reduce_pattern"),
    ],
    "lab2_data_parallel": [
        ("contiguous", "split_strided", "test_split_batch"),
        ("the same sequence of collective calls", "avg_skips_missing_gradients", "test_average_gradients_equal"),
        ("same order", "ddp_launches_buckets_as_they_fill", "test_bucketed_ddp_equal"),
        ("No overlap.", "ddp_no_overlap", "test_bucketed_ddp_overlap"),
        ("per bucket", "ddp_per_parameter_all_reduce", "test_bucketed_ddp_traffic"),
    ],
    "lab3_zero_fsdp": [
        ("reduce-scatter", "rs_all_reduce_then_slice", "test_reduce_scatter_gradients"),
        ("all-gather", "step_missing_all_gather", "test_zero1_equal"),
        ("unit by unit", "zero3_never_frees", "test_zero3_traffic_memory"),
    ],
    "lab4_pipeline": [
        ("micro-batches", "gpipe_no_microbatches", "test_gpipe_schedule"),
        ("steady state", "1f1b_warmup_ignores_rank", "test_1f1b_schedule"),
        ("scaled by `1/m`", "executor_no_loss_scaling", "test_run_pipeline_gradients"),
    ],
    "lab5_tensor_parallel": [
        ("in place", "g_in_place", "test_reduce_from_tp"),
        ("once, after", "row_bias_before_reduce", "test_row_parallel_linear"),
        ("one all-reduce forward, one backward", "f_backward_is_identity", "test_copy_to_tp"),
        ("Grouped-query attention", "attn_gqa_chunk3", "test_tp_attention"),
    ],
    "lab6_context_parallel": [
        ("log-sum-exp", "merge_adds_lses", "test_merge_partial_attention"),
        ("heads first", "ulysses_scatters_the_sequence", "test_ulysses_attention"),
        ("Deadlock-free under any backend.", "ring_everyone_sends_first", "test_ring_attention_forward"),
        ("travel with the block", "ring_src_off_by_direction", "test_ring_attention_forward"),
    ],
    "lab7_3d_parallel": [
        ("TP innermost", "tp_groups_strided", "test_mesh_groups"),
        ("in that coordinate only", "batch_sliced_by_pp_coordinate", "test_train_step_3d"),
        ("model states", "optimizer_states_per_replica", "test_predict_memory"),
    ],
    "lab8_memory": [
        ("With data parallelism the decision must be the same on every rank.", "scaler_overflow_not_agreed",
         "test_DynamicLossScaler"),
        # the scaler agrees over its group, not the whole world (the text: "its group")
        ("With data parallelism the decision must be the same on every rank.", "scaler_agrees_over_the_world",
         "test_DynamicLossScaler"),
        ("in place", "scaler_unscale_not_in_place", "test_DynamicLossScaler"),
        ("Copy back", "mixed_no_copy_back", "test_mixed_precision_step"),
        ("another rank's shard", "zero1_overflow_seen_by_owner_only", "test_zero1_mixed_precision_step"),
        ("replay the random state", "recompute_rng_not_replayed", "test_recompute_blocks"),
    ],
    "lab9_expert_parallel": [
        ("every token's first choice before any token's second choice", "router_token_major_queue",
         "test_top_k_router"),
        ("fraction of the choices", "loss_fraction_not_divided_by_k", "test_load_balancing_loss"),
        ("local experts", "dispatch_rows_left_in_source_order", "test_ep_dispatch"),
        ("Check the input before the first collective", "dispatch_no_split_check", "test_ep_dispatch"),
        ("on both sides", "combine_expert_order_not_undone", "test_ep_combine"),
    ],
    "lab10_checkpointing": [
        ("only its own shards", "save_replica_by_every_rank", "test_save_sharded"),
        ("Atomic and verified.", "save_in_place", "test_save_sharded"),
        ("whatever layout saved it", "load_same_layout_assumed", "test_load_resharded"),
        ("complete and intact", "latest_metadata_only", "test_latest_checkpoint"),
        ("largest `n`", "latest_sorted_by_name", "test_latest_checkpoint"),
        ("Resumed exactly.", "restart_from_scratch", "test_train_resumable"),
        ("bit-identical", "restart_torch_rng_lost", "test_train_resumable"),
        ("the optimizer's state", "restart_optimizer_lost", "test_train_resumable"),
        ("the loss scaler's state", "restart_scaler_lost", "test_train_resumable"),
        ("every random state", "restart_python_rng_lost", "test_train_resumable"),
        ("the data position", "restart_sampler_lost", "test_train_resumable"),
        ("after `n` steps", "restart_save_before_step", "test_train_resumable"),
    ],
    "lab11_overlap": [
        ("exposed communication", "exposed_sums_without_union", "test_exposed_time"),
        ("blocked on communication", "exposed_forgets_issuing", "test_exposed_time"),
        ("FSDP's forward prefetch", "prefetch_after_compute", "test_prefetch_forward"),
        ("decomposed all-gather + matmul", "ag_waits_before_matmul", "test_all_gather_matmul"),
        ("decomposed matmul + reduce-scatter", "rs_waits_before_matmul", "test_matmul_reduce_scatter"),
    ],
}
ROWS = [pytest.param(lab, rule, bug, test, id=f"{lab.split('_')[0]}-{bug}", marks=pytest.mark.course)
        for lab, rows in RULES.items() for rule, bug, test in rows]


def _stressed(lab: str) -> list[str]:
    nb = nbformat.read(os.path.join(ROOT, "labs", lab, f"{lab}.ipynb"), as_version=4)
    return [_plain(b) for c in nb.cells if c.cell_type == "markdown" for b in re.findall(r"\*\*([^*]+)\*\*", c.source)]


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\u2019", "'"))


def test_every_lab_lists_rules_its_text_stresses_and_bugs_its_bank_has():
    labs = sorted(p for p in os.listdir(os.path.join(ROOT, "solutions")) if re.match(r"lab\d+_", p))
    assert set(RULES) <= set(labs) and len(RULES) >= 10, sorted(set(labs) - set(RULES))
    for lab, rows in RULES.items():
        stressed, bank = _stressed(lab), {b["name"]: b for b in load_bank(lab)["BUGS"]}
        for rule, bug, test in rows:
            assert any(_plain(rule) in s for s in stressed), f"{lab}: {rule!r} is not set in bold in the lab's text"
            assert bug in bank and test in bank[bug]["catches"], f"{lab}: {bug} (catching {test})"


def visible_failures(lab: str, bug_name: str, tests: list[str]) -> dict[str, str | None]:
    """{test cell: the AssertionError (or other error) its visible part raises on the solution with the
    bank's ``bug_name`` injected, or None}, the notebook's cells run once, up to the first that fails
    (a cell before the tests that raises, a demo the student runs, counts as the failure)."""
    bug = next(b for b in load_bank(lab)["BUGS"] if b["name"] == bug_name)
    nb = inject(bug, {lab: nbformat.read(os.path.join(ROOT, "solutions", lab, f"{lab}.ipynb"), as_version=4)})[lab]
    namespace, out = {"__name__": "__main__"}, {}
    for i, cell in enumerate(skip_demos(nb).cells):
        if cell.cell_type == "code" and not (nbg(cell).get("grade") and not nbg(cell).get("solution")):
            try:
                exec(compile_cell(strip_solution_markers(cell.source), f"<solution {grade_id(cell)}>"), namespace)
            except Exception as err:        # noqa: BLE001  a cell the student runs before the tests shows it too
                return {f"cell {grade_id(cell) or i}": f"{type(err).__name__}: {err}"}
    for test in tests:
        source = next(c for c in nb.cells if grade_id(c) == test).source
        visible = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", source, flags=re.S)
        try:
            exec(compile(visible, f"<grader {test}>", "exec"), namespace)
            out[test] = None
        except Exception as err:        # noqa: BLE001  a failing visible part is what the row asks for
            out[test] = f"{type(err).__name__}: {err}"
            break
    return out


@pytest.mark.parametrize("lab, rule, bug, test", ROWS)
def test_a_visible_case_breaks_when_a_stressed_rule_is_broken(lab, rule, bug, test):
    catches = next(b for b in load_bank(lab)["BUGS"] if b["name"] == bug)["catches"]
    failed = visible_failures(lab, bug, [test] + [t for t in catches if t != test])
    assert any(failed.values()), f"{lab}: {bug} breaks {rule!r} and passes the visible part of {sorted(failed)}"
