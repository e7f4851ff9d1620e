"""Library answers are refused in every lab: while graded code runs, a call into minidist's own
implementation of the technique being graded (the public function, ``__wrapped__``, an inner helper,
a subclass, the library object handed in as the answer) fails the check with a message that says so,
while the helpers a lab hands out stay usable. Lab 1's cases are in tests/test_checks_collectives.py."""
import ast
import inspect
import os
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

import minidist.data_parallel as DP
import minidist.pipeline as PP
from minidist.checks import lab2_data_parallel as lab2
from minidist.checks import lab3_zero_fsdp as lab3
from minidist.checks import lab4_pipeline as lab4
from minidist.checks.kit.refusal import LibraryAnswer, Refusal, graded_call, refusing
from minidist.checks.lab3_zero_fsdp import cases as lab3_cases
from minidist.checks.lab3_zero_fsdp import stand_ins as lab3_stand_ins

from attack_bank import PRESTARTED_POOL
from autograder.course.cells import grade_id, strip_solution_markers
from conftest import ROOT

REFUSED_TEXT = "called minidist's own implementation"


def _refused(check, *args, what=None, **kw):
    with pytest.raises(AssertionError, match=REFUSED_TEXT) as info:
        check(*args, **kw)
    if what:
        assert what in str(info.value), str(info.value)
    return str(info.value)


# ------------------------------------------------------------------ lab 2
def make_buckets_by_alias(params, cap_bytes):
    return DP.make_buckets(params, cap_bytes)


def average_through_naive_ddp(model):
    DP.NaiveDDP(model, broadcast_from=None).sync_gradients()


class BucketedDDPSubclass(DP.BucketedDDP):
    """The library's class under the lab's name: its hooks run library code on the student's behalf."""
    def __init__(self, model, bucket_cap_bytes=1 << 20):
        super().__init__(model, bucket_cap_bytes=bucket_cap_bytes, broadcast_from=None)


def test_lab2_refuses_the_library():
    msg = _refused(lab2.check_make_buckets, make_buckets_by_alias, what="minidist.data_parallel.common.make_buckets")
    assert "minidist.checks.lab2_data_parallel" in msg and "minidist.launch" in msg   # the rule, in words
    _refused(lab2.check_make_buckets, DP.make_buckets, what="the graded code is minidist's own")
    _refused(lab2.check_average_gradients, average_through_naive_ddp, what="NaiveDDP")
    _refused(lab2.check_bucketed_ddp, BucketedDDPSubclass, what="minidist.data_parallel")


# ------------------------------------------------------------------ lab 3
def reduce_scatter_with_flatshard(unit):
    """A correct answer built on the lab's FlatShard (handed out by the lab: allowed)."""
    flat_grad = unit.layout.flatten([p.grad for p in unit.params], like=unit.shard)
    mine = torch.empty_like(unit.shard)
    dist.reduce_scatter_tensor(mine, flat_grad)
    mine.div_(dist.get_world_size())
    unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
    for p in unit.params:
        p.grad = None


def reduce_scatter_via_library_zero(unit):
    from minidist.data_parallel import zero
    zero.accumulate_shard_grad(unit.shard, torch.zeros_like(unit.shard))      # the library's ZeRO helper


def test_lab3_allows_flatshard_and_refuses_the_rest():
    """The units are the lab's given ShardedUnit (on FlatShard, both handed out)."""
    lab3.check_reduce_scatter_gradients(reduce_scatter_with_flatshard)
    _refused(lab3.check_reduce_scatter_gradients, reduce_scatter_via_library_zero,
             what="minidist.data_parallel.shard_ops.accumulate_shard_grad")


# ------------------------------------------------------------------ lab 3: the stand-ins are no answer
LAB3_FUNCTIONS = ("reduce_scatter_gradients", "sharded_step", "gather_parameters", "free_parameters")
#: the notebook's cells a lab-3 answer runs on: setup, the given classes, the solution's functions
LAB3_CELLS = ("setup", "given_ShardedUnit", "given_Zero", "reduce_scatter_gradients", "sharded_step", "gather_free")


def _lab3_notebook(*answer_cells: str) -> dict:
    """The solution notebook's globals after its setup, given and solution cells, then ``answer_cells``,
    each run as a notebook cell of its own."""
    nb = nbformat.read(os.path.join(ROOT, "solutions", "lab3_zero_fsdp", "lab3_zero_fsdp.ipynb"), as_version=4)
    notebook = {"__name__": "__main__"}
    for cell in nb.cells:
        if grade_id(cell) in LAB3_CELLS:
            exec(compile(strip_solution_markers(cell.source), f"<solution {grade_id(cell)}>", "exec"), notebook)
    for k, source in enumerate(answer_cells):
        exec(compile(source, f"<cell answer {k}>", "exec"), notebook)
    return notebook


def _pasted_stand_in(name: str) -> str:
    """The stand-in for ``name`` as a student would paste it into a cell: its module's imports, then it."""
    source = inspect.getsource(lab3_stand_ins)
    keep = [node for node in ast.parse(source).body
            if isinstance(node, ast.ImportFrom) and node.module != "__future__"
            or isinstance(node, ast.FunctionDef) and node.name == name]
    return "\n\n".join(ast.get_source_segment(source, node) for node in keep)


def _lab3_tests_of(name: str, notebook: dict) -> list:
    """The notebook's test cells that grade ``name`` (cases.GRADED), as calls on ``notebook``."""
    zero = lambda stage: lambda: lab3.check_zero(notebook["Zero"], stage=stage)      # noqa: E731
    unit = lambda: lab3.check_reduce_scatter_gradients(notebook["reduce_scatter_gradients"])  # noqa: E731
    stages = [stage for stage, graded in lab3_cases.GRADED.items() if name in graded]
    return ([unit] if name == "reduce_scatter_gradients" else []) + [zero(stage) for stage in stages]


@pytest.mark.parametrize("how", ["called", "pasted"])
@pytest.mark.parametrize("name", LAB3_FUNCTIONS)
def test_lab3_a_stand_in_handed_in_as_the_answer_earns_nothing(name, how):
    """Issue 58: the student wheel holds lab 3's stand-ins (thin adapters over minidist.data_parallel). One
    imported as the answer for the function it stands in for is refused; so is its source pasted into a
    notebook cell (never refused by its code), because it calls the library: each test that grades it fails."""
    answer = (f"from minidist.checks.lab3_zero_fsdp.stand_ins import {name}" if how == "called"
              else _pasted_stand_in(name))
    notebook = _lab3_notebook(answer)
    assert notebook[name].__code__.co_filename.startswith("<cell" if how == "pasted" else os.sep)
    where = f"stand_ins.{name}" if how == "called" else "minidist.data_parallel.shard_ops."
    for test in _lab3_tests_of(name, notebook):
        _refused(test, what=where)


GATHER_THROUGH_THE_STEPS_STAND_IN = """
from minidist.checks.lab3_zero_fsdp.stand_ins import sharded_step as library_step

class NoStep:
    def step(self):
        pass

def gather_parameters(unit):
    unit.flat.untyped_storage().resize_(unit.nbytes)
    library_step([unit], NoStep())          # the library's all-gather, through another function's stand-in
"""


def test_lab3_a_stand_in_the_stage_does_not_use_is_refused_too():
    """ZeRO-3 never calls sharded_step: its stand-in is refused there, so a gather_parameters cannot borrow
    its all-gather."""
    notebook = _lab3_notebook(GATHER_THROUGH_THE_STEPS_STAND_IN)
    _refused(lab3.check_zero, notebook["Zero"], stage=3, what="stand_ins.sharded_step")


def test_lab3_the_solution_passes_with_the_stand_ins_allowed():
    """With library answers refused, each stage grades the solution's functions while the library's
    stand-ins (allowed there, and only there) replace the others."""
    notebook = _lab3_notebook()
    lab3.check_reduce_scatter_gradients(notebook["reduce_scatter_gradients"])
    for stage in lab3_cases.GRADED:
        lab3.check_zero(notebook["Zero"], stage=stage)


def _data_parallel_names(tree: ast.Module) -> set:
    """The names a module imports from minidist.data_parallel (and the module names themselves)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minidist.data_parallel"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.startswith("minidist.data_parallel")}
    return names


def test_lab3s_checks_hold_no_answer_only_adapters_over_the_library():
    """Nothing in minidist/checks/lab3_zero_fsdp/ (what the student wheel ships) defines one of the lab's
    four functions except a thin adapter: one statement, a call of something from minidist.data_parallel."""
    found = []
    for path in sorted((Path(ROOT) / "minidist" / "checks" / "lab3_zero_fsdp").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        library = _data_parallel_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in LAB3_FUNCTIONS:
                found.append(f"{path.name}:{node.name}")
                body = node.body
                call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Expr) else None
                callee = getattr(call, "func", None)
                root = callee
                while isinstance(root, ast.Attribute):
                    root = root.value
                assert isinstance(call, ast.Call) and isinstance(root, ast.Name) and root.id in library, (
                    f"{path.name} defines {node.name} (line {node.lineno}) as more than one call into "
                    f"minidist.data_parallel: an answer the student wheel would ship")
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in LAB3_FUNCTIONS
                                                      for t in node.targets):
                raise AssertionError(f"{path.name} binds one of the lab's functions (line {node.lineno})")
    assert sorted(found) == sorted(f"stand_ins.py:{name}" for name in LAB3_FUNCTIONS), found


# ------------------------------------------------------------------ lab 4
def gpipe_from_make(p, m):
    return PP.make("gpipe", p, m)


def gpipe_from_with_comms(p, m):
    from minidist.pipeline.schedules import with_comms
    order = [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
    return with_comms("gpipe", p, m, 1, order)


def executor_via_library(s, chunks, x, y, costs=None):
    return PP.run_schedule(s, chunks, x, y, costs=costs).loss


def test_lab4_refuses_schedule_builders_and_the_executor():
    _refused(lab4.check_gpipe_schedule, gpipe_from_make, what="minidist.pipeline.schedules.make")
    _refused(lab4.check_gpipe_schedule, gpipe_from_with_comms, what="with_comms")
    _refused(lab4.check_run_pipeline, executor_via_library, what="minidist.pipeline.executor.run_schedule")


def test_allowed_helpers_and_the_checks_own_calls_pass():
    """Action, Schedule and timed are the lab's building blocks: a hand-written GPipe uses them."""
    def gpipe(p, m):
        acts = []
        for r in range(p):
            prog = []
            for i in range(m):
                prog += ([PP.Action("RECV_F", i, peer=r - 1)] if r else []) + [PP.Action("F", i)] + \
                        ([PP.Action("SEND_F", i, peer=r + 1)] if r < p - 1 else [])
            for i in range(m):
                prog += ([PP.Action("RECV_B", i, peer=r + 1)] if r < p - 1 else []) + [PP.Action("B", i)] + \
                        ([PP.Action("SEND_B", i, peer=r - 1)] if r else [])
            acts.append(prog)
        s = PP.Schedule("gpipe", p, m, 1, acts)
        s.compute(0)
        return s
    lab4.check_gpipe_schedule(gpipe)


def test_a_swallowed_refusal_or_a_removed_tracer_still_fails():
    refusal = Refusal("pipelines", ("minidist.pipeline.schedules",))

    def swallow():
        try:
            PP.make("gpipe", 2, 2)
        except LibraryAnswer:
            pass
        return "done"

    def untrace():
        import sys
        sys.settrace(None)
        return PP.make("gpipe", 2, 2)

    with pytest.raises(AssertionError, match=REFUSED_TEXT):
        graded_call(refusal, "swallow", swallow)
    with pytest.raises(AssertionError, match="turned off the check"):
        graded_call(refusal, "untrace", untrace)
    with refusing(None):                   # no refusal: nothing happens
        PP.make("gpipe", 2, 2)


# ------------------------------------------------------------------ lab 5
def f_from_library_class(x, group=None):
    from minidist.tensor_parallel.comm import CopyToTP
    return CopyToTP.apply(x, group)


def column_from_library(x, weight, bias=None, group=None):
    from minidist.tensor_parallel import column_parallel_linear
    return column_parallel_linear(x, weight, bias, group)


def copy_to_tp(x, group=None):
    """A student's f that is not written yet: lab 5 stands minidist's in for it in other tests."""
    raise NotImplementedError


def column_on_the_notebooks_f(x, weight, bias=None, group=None):
    return torch.nn.functional.linear(copy_to_tp(x, group), weight, bias)


def test_lab5_refuses_the_library_but_stands_it_in_for_other_functions():
    from minidist.checks import lab5_tensor_parallel as lab5
    # f's own test refuses minidist's f, even the autograd class the column test needs
    _refused(lab5.check_copy_to_tp, f_from_library_class, what="CopyToTP")
    _refused(lab5.check_column_parallel_linear, column_from_library,
             what="minidist.tensor_parallel.layers.column_parallel_linear")
    # a column layer on an unfinished f passes: minidist's f stands in inside the ranks
    lab5.check_column_parallel_linear(column_on_the_notebooks_f)


# ------------------------------------------------------------------ every thread, every name
def _gpipe_source_exec_d_elsewhere():
    """The library's schedules module compiled again under another file name, its @api regions dropped."""
    import inspect
    from minidist.pipeline import schedules
    source = "\n".join(line for line in inspect.getsource(schedules).splitlines() if not line.lstrip().startswith("@api"))
    import sys
    import types
    module = sys.modules["mine"] = types.ModuleType("mine")      # dataclasses look their module up
    exec(compile(source, "<mine>", "exec"), vars(module))
    return vars(module)


def test_the_library_is_recognised_by_its_code_not_its_file_name():
    refusal = Refusal("pipelines", ("minidist.pipeline.schedules",))
    mine = _gpipe_source_exec_d_elsewhere()
    with pytest.raises(AssertionError, match=REFUSED_TEXT + ": mine.make"):
        graded_call(refusal, "copied", mine["make"], "gpipe", 2, 2)
    # outside the graded call the copy runs: it is the same code, refused only where answers are graded
    assert mine["make"]("gpipe", 2, 2) is not None


def test_threads_started_by_graded_code_are_refused_too():
    import _thread
    import threading
    refusal = Refusal("pipelines", ("minidist.pipeline.schedules",))
    early = _thread.start_new_thread

    def on(start):
        def graded():
            done, errors = threading.Event(), []

            def work():
                try:
                    PP.make("gpipe", 2, 2)
                except BaseException as err:  # noqa: BLE001
                    errors.append(err)
                finally:
                    done.set()
            start(work)
            done.wait(10)
            return errors
        return graded

    for start in (lambda f: threading.Thread(target=f).start(), lambda f: _thread.start_new_thread(f, ())):
        with pytest.raises(AssertionError, match=REFUSED_TEXT):
            graded_call(refusal, "threaded", on(start))
    assert _thread.start_new_thread is early          # put back after the graded call
    seen = []
    graded_call(refusal, "backward", lambda: seen.append(torch._C._is_multithreading_enabled()))
    assert seen == [False] and torch._C._is_multithreading_enabled()     # autograd: the calling thread only


def test_a_thread_running_before_the_graded_call_is_refused_library_answers():
    """Issue 27: a pool worker started before the graded call (in a solution cell) answers with
    minidist's ring_all_reduce: refused like a call on the graded thread; the same pool doing the
    student's own work is not (a pure check's ``graded_call``, as labs 2, 4 and 6 make; 0.1 s)."""
    refused = Refusal("an all-reduce", ("minidist.collectives",))
    ns: dict = {}
    exec(compile(PRESTARTED_POOL, "<cell prestarted>", "exec"), ns)
    try:
        with pytest.raises(AssertionError, match="called minidist's own implementation: minidist.collectives"):
            graded_call(refused, "allsum", ns["allsum"], torch.ones(3))
        assert torch.equal(graded_call(refused, "honest", ns["honest"], torch.ones(3)), torch.full((3,), 2.0))
    finally:
        ns["pool"].shutdown()
