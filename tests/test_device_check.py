"""The device check (minidist/checks/kit/device_check.py, issue 43): a lab's check run once with
torch's default device ``meta``, so that a tensor made without ``device=`` fails on a laptop as it
would on a GPU node, with a message naming the line that made it.

Each lab's row takes its bank bug that makes a tensor without a device, runs the solution notebook's
cells with that one cell broken, in this process, then the device test cell, and asserts the line
and the GPU node's consequence; the same cell passes on the solution (marker ``course``). Two
kit-level rows (``make test``) cover a ``"here"`` check, which sets the default device in this
process and must put it back, and a launched one, whose ranks each record the lines they made.
"""
import importlib
import linecache
import os
import re

import nbformat
import pytest
import torch

from autograder.course.cells import grade_id, nbg, skip_demos, strip_solution_markers
from autograder.selftest.bank import inject, load_bank
from minidist.checks.kit.check import Registry
from minidist.checks.kit.device_check import GPU_NODE, on_meta
from minidist.checks.kit.run import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LABS = [
    # (lab, bank bug that makes a tensor without a device, the device test cell, the line it names)
    ("lab1_collectives", "ring_buffer_without_device", "test_collectives_device",
     "incoming = torch.zeros(len(chunks[recv_index]), dtype=tensor.dtype)"),
    ("lab2_data_parallel", "avg_missing_gradient_without_device", "test_data_parallel_device",
     "p.grad = torch.zeros(p.shape)"),
    ("lab3_zero_fsdp", "rs_output_without_device", "test_zero_device",
     "mine = torch.empty(unit.layout.shard_numel, dtype=unit.shard.dtype)"),
    ("lab4_pipeline", "executor_buffers_without_device", "test_run_pipeline_device",
     "received[key] = torch.empty(xs[0].shape, dtype=x.dtype)"),
    ("lab5_tensor_parallel", "sp_gather_buffer_without_device", "test_tp_device",
     "out = torch.empty((t * parts.shape[0], *parts.shape[1:]), dtype=parts.dtype)"),
    ("lab6_context_parallel", "ring_buffer_without_device", "test_cp_device",
     "incoming = torch.empty(kv.shape, dtype=kv.dtype)"),
    ("lab7_3d_parallel", "loss_report_without_device", "test_train_step_3d_device",
     "loss = torch.tensor([stats.loss if stats.loss is not None else 0.0], dtype=torch.float64)"),
    ("lab8_memory", "scaler_flag_without_device", "test_memory_device", "bad = torch.zeros(1)"),
    ("lab9_expert_parallel", "dispatch_counts_without_device", "test_ep_device",
     "recv_counts = torch.empty(num_experts, dtype=torch.long)"),
    ("lab10_checkpointing", "load_pieces_without_device", "test_load_resharded_device",
     'mine = torch.empty(lengths, dtype=getattr(torch, t["dtype"]))'),
    ("lab11_overlap", "ag_output_without_device", "test_overlap_device",
     "out = torch.empty((t * n, weight.shape[0]), dtype=x_shard.dtype)"),
]


def compile_cell(source: str, filename: str):
    """``source`` compiled as a notebook kernel does: its lines kept in ``linecache`` under ``filename``."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return compile(source, filename, "exec")


def device_cell(lab: str, bug_name: str | None, test_id: str) -> str | None:
    """The AssertionError's message of the visible part of test cell ``test_id`` on the solution (with
    the bank's ``bug_name`` injected), or None when it passes."""
    nb = nbformat.read(os.path.join(ROOT, "solutions", lab, f"{lab}.ipynb"), as_version=4)
    if bug_name is not None:
        bug = next(b for b in load_bank(lab)["BUGS"] if b["name"] == bug_name)
        nb = inject(bug, {lab: nb})[lab]
    namespace = {"__name__": "__main__"}
    for cell in skip_demos(nb).cells:
        if cell.cell_type != "code" or (nbg(cell).get("grade") and not nbg(cell).get("solution")):
            continue            # test cells: only the one asked for runs, below
        exec(compile_cell(strip_solution_markers(cell.source), f"<solution {grade_id(cell)}>"), namespace)
    test = next(c for c in nb.cells if grade_id(c) == test_id).source
    visible = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", test, flags=re.S)
    try:
        exec(compile(visible, f"<grader {test_id}>", "exec"), namespace)
    except AssertionError as err:
        return str(err)
    return None


VALUE_BUGS = [
    # (lab, bank bug that computes a wrong value and makes every tensor on its inputs' device, the device test cell)
    ("lab1_collectives", "naive_recv_overwrites_sum", "test_collectives_device"),
    ("lab2_data_parallel", "avg_forgets_to_average", "test_data_parallel_device"),
    ("lab3_zero_fsdp", "rs_forgets_to_average", "test_zero_device"),
    ("lab4_pipeline", "executor_no_loss_scaling", "test_run_pipeline_device"),
    ("lab5_tensor_parallel", "ce_local_max", "test_tp_device"),
    ("lab6_context_parallel", "ring_no_merge", "test_cp_device"),
    ("lab7_3d_parallel", "grads_not_divided_by_dp", "test_train_step_3d_device"),
    ("lab8_memory", "zero1_sum_not_mean", "test_memory_device"),
    ("lab9_expert_parallel", "combine_expert_order_not_undone", "test_ep_device"),
    ("lab10_checkpointing", "load_overlap_not_clipped", "test_load_resharded_device"),
]

#: a lab's rows run its notebook and its launches: they belong to the course's stage (``make test-course``)
ROWS = [pytest.param(*row, id=row[0], marks=pytest.mark.course) for row in LABS]


@pytest.mark.parametrize("lab, bug, test, line", ROWS)
def test_a_tensor_made_without_a_device_fails_the_device_check_naming_its_line(lab, bug, test, line):
    message = device_cell(lab, bug, test)
    assert message is not None, f"{bug} passed {test}"
    advice = importlib.import_module(f"minidist.checks.{lab}").DEVICE
    advice = next(iter(advice.values()))[0].device_advice or GPU_NODE     # lab 10's: host memory, not the inputs'
    assert "without device=" in message and advice in message, message
    made = message.split("without device=", 1)[1]
    # the cell is named after its first definition (lab 5's sp_gather cell: "SPGather")
    assert re.search(r'notebook cell "\w+", line \d+, in \w+\n\s+' + re.escape(line), made), message


@pytest.mark.parametrize("lab, bug, test", [pytest.param(*row, id=row[0], marks=pytest.mark.course)
                                             for row in VALUE_BUGS])
def test_a_wrong_value_made_on_the_right_devices_passes_the_device_check(lab, bug, test):
    """One mistake costs one test: the bug fails its function's test (the bank says so), not the device
    test, which judges where tensors are made and nothing else."""
    assert bug in [b["name"] for b in load_bank(lab)["BUGS"] if test not in b["catches"]]
    assert device_cell(lab, bug, test) is None


@pytest.mark.parametrize("lab, bug, test, line", ROWS)
def test_the_solution_passes_its_device_check(lab, bug, test, line, capsys):
    assert device_cell(lab, None, test) is None
    assert "(device check): one visible case with torch's default device meta" in capsys.readouterr().out


# ----------------------------------------------------------------------------- a check made here
def _scaled(fn, case):
    x = torch.arange(4.0, device="cpu") * case
    return fn(x).tolist()


def _times_two(case, got):
    want = [2.0 * case * i for i in range(4)]
    return None if got == want else f"got {got}, expected {want}"


def _times_two_on_every_rank(case, got):
    return next(filter(None, (_times_two(case, answer) for answer in got)), None)


HERE = on_meta(Registry(__name__).check("double", lambda hidden: [1, 3], _scaled, _times_two))
ON_RANKS = on_meta(Registry(__name__).check("double on ranks", lambda hidden: [2], _scaled, _times_two_on_every_rank,
                                            where="launch", world=lambda case: 2, timeout=60.0))
STUDENT = """
def double(x):
    return x + x

def double_with_a_new_tensor(x):
    two = torch.full((len(x),), 2.0)
    return x * two
"""


def test_a_here_check_on_meta_names_the_line_and_restores_the_default_device(capsys):
    namespace = {"torch": torch}
    exec(compile_cell(STUDENT, "<cell double>"), namespace)
    run(HERE, namespace["double"])
    assert "double (device check): one visible case" in capsys.readouterr().out
    with pytest.raises(AssertionError) as info:
        run(HERE, namespace["double_with_a_new_tensor"])
    message = str(info.value)
    assert re.search(r'notebook cell "double_with_a_new_tensor", line 6, in double_with_a_new_tensor\n\s+'
                     r'two = torch\.full\(\(len\(x\),\), 2\.0\)', message) and GPU_NODE in message, message
    assert torch.get_default_device() == torch.device("cpu")
    assert torch.zeros(1).device.type == "cpu"
    assert HERE.cases() == [1] and HERE.params == ()


def test_the_passed_line_states_the_labs_rule_where_it_is_not_the_inputs_device(capsys):
    """Lab 10's pieces belong in host memory, not on their inputs' device: its ✓ line says so."""
    from minidist.checks import lab10_checkpointing as lab10
    namespace = {"torch": torch}
    exec(compile_cell(STUDENT, "<cell double>"), namespace)
    run(on_meta(Registry(__name__).check("double", lambda hidden: [1], _scaled, _times_two), rule="on the host"),
        namespace["double"])
    assert capsys.readouterr().out.rstrip().endswith("as a GPU node sees it: on the host")
    (device_check,) = lab10.DEVICE["load_resharded"]
    assert device_check.covered().endswith("every piece it returns is in host memory")
    assert HERE.covered().endswith("every tensor it made is on its inputs' device")


WRONG = """
def triple(x):
    return x * 3

def raises(x):
    return x[len(x)]

def stub(x):
    # YOUR CODE HERE
    raise NotImplementedError()
"""


@pytest.mark.parametrize("check", [HERE, ON_RANKS], ids=["here", "launched"])
@pytest.mark.parametrize("name", ["triple", "raises"])
def test_a_wrong_answer_without_a_tensor_on_meta_passes_the_device_check_and_its_judge(check, name, capsys,
                                                                                     monkeypatch):
    """The device check judges where tensors are made: a wrong value or an error of the student's own
    (no tensor made without device=) passes it, in the notebook and in the grader's judge, which reads
    the record filed in the answer's place."""
    from minidist.checks.kit import docket
    namespace = {"torch": torch}
    exec(compile_cell(WRONG, "<cell wrong>"), namespace)
    monkeypatch.setattr(docket, "ON", True)
    del docket.entries()[:]
    run(check, namespace[name])
    assert "(device check): one visible case" in capsys.readouterr().out
    assert docket.entries() and check.judge({}, docket.entries()) is None
    del docket.entries()[:]
    assert "no answer was filed" in check.judge({}, [])          # the judge passes only what was filed


@pytest.mark.parametrize("check", [HERE, ON_RANKS], ids=["here", "launched"])
def test_a_function_not_written_yet_fails_the_device_check(check):
    """The release's stub (NotImplementedError) has shown nothing about where it makes tensors: no point."""
    namespace = {"torch": torch}
    exec(compile_cell(WRONG, "<cell wrong>"), namespace)
    with pytest.raises(AssertionError, match=r"not written yet \(.*NotImplementedError"):
        run(check, namespace["stub"])


def test_a_launched_check_on_meta_names_the_line_every_rank_made(capsys):
    namespace = {"torch": torch}
    exec(compile_cell(STUDENT, "<cell double>"), namespace)
    run(ON_RANKS, namespace["double"])
    assert "double on ranks (device check): one visible case" in capsys.readouterr().out
    with pytest.raises(AssertionError) as info:
        run(ON_RANKS, namespace["double_with_a_new_tensor"])
    message = str(info.value)
    assert message.startswith("double on ranks (device check): your code made a tensor without device="), message
    assert "ranks 0-1 raised: RuntimeError" in message and "rank 0" not in message, message    # folded
    assert message.count("two = torch.full") == 1, message
    assert re.search(r'notebook cell "double_with_a_new_tensor", line 6, in double_with_a_new_tensor\n\s+'
                     r'two = torch\.full\(\(len\(x\),\), 2\.0\)', message) and GPU_NODE in message, message
    assert torch.get_default_device() == torch.device("cpu")
