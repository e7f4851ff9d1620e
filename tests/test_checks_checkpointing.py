"""Lab 10's checks grade the student's own checkpointing (issue 58). The solution earns every test;
an answer built on minidist's checkpointing, or on the checkpoints the checks write with it
(``minidist.checks.lab10_checkpointing.checkpoints``, a thin adapter over the library), earns
nothing, whether it calls them or pastes the adapter into a notebook cell (code compiled there is
never refused by its text: the adapter's body calls the library, which is); and nothing in the
checks defines an exercise or a writer of its own. (The bug bank and the correct alternatives are
in solutions/lab10_checkpointing/bugbank.py, run by the selftest.)"""
import ast
import inspect
import linecache
import os
import re

import nbformat
import pytest

from autograder.course.cells import grade_id, nbg, skip_demos, strip_solution_markers
from minidist.checks import lab10_checkpointing as lab10
from minidist.checks.kit.refusal import resolve
import minidist
from minidist.checks.lab10_checkpointing import cases, checkpoints, restart_kit, train_resumable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(lab10.__file__)
REFUSED = "called minidist's own implementation"

#: the checks' writer, as a student would paste it into a cell (its import first)
PASTED_WRITER = "from minidist.checkpoint import portable\n\n" + inspect.getsource(checkpoints.write)

#: the cheat graded 8/8 when the checks' writer was lab 10's reference (reference.write)
SAVE_THROUGH_THE_CHECKS = '''
from minidist.checks.lab10_checkpointing import checkpoints as written

def save_sharded(state, layout, path):
    tmp = path + ".tmp"
    written.write(dict(state), layout, tmp)
    os.rename(tmp, path)
'''
SAVE_THROUGH_THE_LIBRARY = '''
from minidist.checkpoint import portable

def save_sharded(state, layout, path):
    portable.save_portable(dict(state), layout, path)
'''
SAVE_WITH_THE_WRITER_PASTED = PASTED_WRITER + '''

def save_sharded(state, layout, path):
    tmp = path + ".tmp"
    write(dict(state), layout, tmp)
    os.rename(tmp, path)
'''
LOAD_THROUGH_THE_LIBRARY = '''
from minidist.checkpoint import portable

def load_resharded(path, layout, rank):
    return portable.load_portable(path, layout, rank)
'''
#: reads the full tensors itself and has the writer cut them into the new layout's pieces
RESHARD_BY_WRITING = '''
def load_resharded(path, layout, rank):
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"{meta_path} is missing")
    with open(meta_path) as f:
        meta = json.load(f)
    full = {}
    for name, t in meta["tensors"].items():
        full[name] = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]), device="cpu")
        for s in t["shards"]:
            with safe_open(os.path.join(path, s["file"]), framework="pt") as f:
                full[name][tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["lengths"]))] = f.get_tensor(name)
    with tempfile.TemporaryDirectory() as tmp:
        WRITE(full, layout, os.path.join(tmp, "cut"))
        with safe_open(os.path.join(tmp, "cut", f"rank{rank}.safetensors"), framework="pt") as f:
            return {name: f.get_tensor(name) for name in full}
'''
LOAD_THROUGH_THE_CHECKS = "from minidist.checks.lab10_checkpointing import checkpoints\n" + RESHARD_BY_WRITING.replace(
    "WRITE(", "checkpoints.write(")
LOAD_WITH_THE_WRITER_PASTED = PASTED_WRITER + RESHARD_BY_WRITING.replace("WRITE(", "write(")
LATEST_THROUGH_THE_LIBRARY = '''
from minidist.checkpoint import CheckpointError, portable

def latest_checkpoint(root):
    steps = sorted((int(d[5:]), d) for d in os.listdir(root) if re.fullmatch(r"step_[0-9]+", d))
    for _, d in reversed(steps):
        try:
            portable.verify_portable(os.path.join(root, d))
            return os.path.join(root, d)
        except CheckpointError:
            continue
    return None
'''
#: a thin adapter over the library's verifier, pasted as the checks' writer would be
LATEST_WITH_AN_ADAPTER_PASTED = '''
from minidist.checkpoint import portable


def verify(path):
    """The portable checkpoint's metadata once its files verify: the library's."""
    return portable.verify_portable(path)


def latest_checkpoint(root):
    steps = sorted((int(d[5:]), d) for d in os.listdir(root) if re.fullmatch(r"step_[0-9]+", d))
    for _, d in reversed(steps):
        try:
            verify(os.path.join(root, d))
            return os.path.join(root, d)
        except ValueError:
            continue
    return None
'''
INTERVAL_THROUGH_THE_COST_MODEL = '''
from minidist.cost import daly_interval, job_mtbf, young_interval

def checkpoint_interval(save_s, gpu_mtbf_s, gpus):
    m = job_mtbf(gpu_mtbf_s, gpus)
    return {"mtbf_s": m, "young_s": young_interval(save_s, m), "daly_s": daly_interval(save_s, m)}
'''
GOODPUT_THROUGH_THE_COST_MODEL = '''
import minidist.cost

def goodput(interval_s, save_s, mtbf_s, restart_s=0.0, blocking_s=None):
    return minidist.cost.goodput(interval_s, save_s, mtbf_s, restart_s, blocking_s)
'''
#: the random states collected by the library's checkpoint (every generator's get and set) instead of by hand
RESTART_WITH_THE_LIBRARYS_RNG = '''
from minidist.checkpoint.rng import rng_sources

def train_resumable(model, optimizer, scaler, sampler, store, steps, every, group=None):
    sources = rng_sources(cuda=False)
    start, found = 0, store.latest()
    if found is not None:
        start, state = found
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])
        for name, (get, put) in sources.items():
            put(state["rng"][name])
    for n in range(start + 1, steps + 1):
        training_step(model, optimizer, scaler, sampler.next_batch(), group)
        if n % every == 0:
            store.save(n, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "scaler": None if scaler is None else scaler.state_dict(), "sampler": sampler.state_dict(),
                           "rng": {name: get() for name, (get, put) in sources.items()}})
    return start
'''
CHEATS = [("checkpoint_interval", "through_the_cost_model", INTERVAL_THROUGH_THE_COST_MODEL, "job_mtbf"),
          ("train_resumable", "through_the_library", RESTART_WITH_THE_LIBRARYS_RNG, "rng_sources"),
          ("goodput", "through_the_cost_model", GOODPUT_THROUGH_THE_COST_MODEL, "goodput"),
          ("save_sharded", "through_the_checks", SAVE_THROUGH_THE_CHECKS, "checkpoints.write"),
          ("save_sharded", "through_the_library", SAVE_THROUGH_THE_LIBRARY, "portable.save_portable"),
          ("save_sharded", "writer_pasted", SAVE_WITH_THE_WRITER_PASTED, "portable.save_portable"),
          ("load_resharded", "through_the_library", LOAD_THROUGH_THE_LIBRARY, "portable.load_portable"),
          ("load_resharded", "through_the_checks", LOAD_THROUGH_THE_CHECKS, "checkpoints.write"),
          ("load_resharded", "writer_pasted", LOAD_WITH_THE_WRITER_PASTED, "portable.save_portable"),
          ("latest_checkpoint", "through_the_library", LATEST_THROUGH_THE_LIBRARY, "portable.verify_portable"),
          ("latest_checkpoint", "adapter_pasted", LATEST_WITH_AN_ADAPTER_PASTED, "portable.verify_portable")]


def compile_cell(source: str, filename: str):
    """``source`` compiled as a notebook kernel does: its lines kept in ``linecache`` under ``filename``."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return compile(source, filename, "exec")


@pytest.fixture(scope="module")
def notebook():
    """(the namespace after the setup and solution cells, {test cell id: its source with the hidden tests})."""
    nb = skip_demos(nbformat.read(os.path.join(ROOT, "solutions", "lab10_checkpointing",
                                               "lab10_checkpointing.ipynb"), as_version=4))
    namespace, tests = {"__name__": "__main__"}, {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if nbg(cell).get("grade") and not nbg(cell).get("solution"):
            tests[grade_id(cell)] = cell.source
            continue
        exec(compile_cell(strip_solution_markers(cell.source), f"<solution {grade_id(cell)}>"), namespace)
    return namespace, tests


def test_the_solution_earns_every_test(notebook, capsys):
    namespace, tests = notebook
    assert sorted(tests) == sorted([f"test_{name}" for name in cases.GRADED] + ["test_load_resharded_device"])
    for test_id, source in tests.items():
        exec(compile(source, f"<grader {test_id}>", "exec"), dict(namespace))      # visible and hidden cases
    out = capsys.readouterr().out
    assert out.count("✓") == 2 * len(cases.GRADED) + 1, out       # + load_resharded's device check
    assert "✓ load_resharded (device check)" in out


@pytest.mark.parametrize("name, how, source, target", CHEATS, ids=[f"{c[0]}-{c[1]}" for c in CHEATS])
def test_an_answer_on_the_library_or_the_checks_writer_earns_nothing(name, how, source, target, notebook):
    namespace = dict(notebook[0])
    exec(compile_cell(source, f"<cell {name}-{how}>"), namespace)
    for hidden in (False, True):
        with pytest.raises(AssertionError, match=REFUSED) as info:
            getattr(lab10, f"check_{name}")(namespace[name], hidden=hidden)
        assert target in str(info.value) and "notebook cell" in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- what the checks hold
NAMED_LIKE_A_WRITER = re.compile(r"^_*(save|load|latest|write|read|export|verify)(_|$)")
#: what the restart exercise hands out under such names (restart_kit.py): the store's rank-local save and latest,
#: the sampler's load_state_dict; none writes or reads the lab's format
RESTART_KIT = {"save", "latest", "load_state_dict"}


def _library_names(tree: ast.Module) -> set[str]:
    """The names a module binds to minidist.checkpoint or something inside it."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minidist.checkpoint"):
            out |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "minidist":
            out |= {a.asname or a.name for a in node.names if a.name == "checkpoint"}
        elif isinstance(node, ast.Import):
            out |= {a.asname for a in node.names if a.name.startswith("minidist.checkpoint") and a.asname}
    return out


def _thin_adapter(fn: ast.FunctionDef, library: set[str]) -> bool:
    """Whether ``fn``'s body (after its docstring) is one call into the library, nothing else."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if len(body) != 1 or not isinstance(body[0], (ast.Expr, ast.Return)) or not isinstance(body[0].value, ast.Call):
        return False
    callee = body[0].value.func
    while isinstance(callee, ast.Attribute):
        callee = callee.value
    return isinstance(callee, ast.Name) and callee.id in library


def test_the_checks_define_no_exercise_and_no_writer_but_thin_adapters_into_the_library():
    files = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert "reference.py" not in files and "checkpoints.py" in files
    adapters = []
    for f in files:
        source = open(os.path.join(PACKAGE, f)).read()
        tree = ast.parse(source, f)
        if f == "faults.py":        # wraps safetensors' save_file for one call (to make it fail), writes nothing
            assert {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} == {"failing", "observed", "_is_named"}
        else:
            assert "safetensors.torch" not in source, f"{f} writes files itself"
        assert "write_safetensors" not in source, f"{f} writes files itself"
        library = _library_names(tree)
        if f == "restart_kit.py":    # the restart exercise's store: one torch.save file per rank, no format of the lab's
            assert "torch.save(" in source and "metadata.json" not in source and "safe_open" not in source
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if f == "restart_kit.py" and fn.name in RESTART_KIT:
                continue
            if f == "cases.py" and re.fullmatch(r"(save|load|latest)_(cases|covered)", fn.name):
                assert [a.arg for a in fn.args.args] == ["hidden"], f"{f}: {fn.name}"      # a case table
            elif fn.name in cases.GRADED or NAMED_LIKE_A_WRITER.match(fn.name):
                assert _thin_adapter(fn, library), f"{f}: {fn.name} is named like an exercise or a writer"
                adapters.append(f"{f[:-3]}.{fn.name}")
    assert adapters == ["checkpoints.write"]


def test_the_refusal_covers_the_checks_writer():
    refused_files, _, _, _ = resolve(lab10.REFUSED)
    assert checkpoints.__file__ in refused_files
    assert not set(lab10.REFUSED.allow)           # the lab hands out nothing of the library or of its writer
    assert {lab10.box.__module__, lab10.sha256_of.__module__, lab10.split_range.__module__} == \
        {"minidist.checks.lab10_checkpointing.helpers"}


# ----------------------------------------------------------------------------- the restart exercise
def _plain_loop(steps: int, scaler: bool) -> dict:
    """Inside a rank: ``steps`` of the handed-out step from a fresh run, no checkpoint: what the verdict rebuilds."""
    import torch.distributed as dist
    model, optimizer, scaler, sampler = restart_kit.new_run(dist.get_rank(), dist.get_world_size(), scaler)
    for _ in range(steps):
        restart_kit.training_step(model, optimizer, scaler, sampler.next_batch())
    return train_resumable.final_state(model, optimizer, scaler, sampler)


@pytest.mark.parametrize("scaler", [True, False])
def test_the_restart_verdicts_reference_is_the_plain_loop_on_two_ranks(scaler):
    """The verdict trains both ranks in one process (their generators swapped in turn, the gradients summed as
    the all-reduce sums them): bit for bit what 2 launched ranks end with, every random state included, and the
    loss scaler's state changed on the way (its overflows are what a restored scaler must reproduce)."""
    case = dict(steps=8, every=3, scaler=scaler, kills=())
    ranks = minidist.launch(_plain_loop, train_resumable.WORLD, case["steps"], scaler, device="cpu")
    want = train_resumable.reference(case)
    for got, ref in zip(ranks, want):
        assert train_resumable.state_problem(got, ref, killed=True) is None
        assert got["rng"] == ref["rng"] and got["sampler"] == ref["sampler"] == {"epoch": 1, "position": 12}
    assert ranks[0]["rng"] != ranks[1]["rng"]           # each rank draws its own numbers
    if scaler:
        assert want[0]["scaler"]["skipped"] > 0 and want[0]["scaler"]["scale"] != restart_kit.SCALER["init_scale"]


def _raises(model, optimizer, scaler, sampler, store, steps, every, group=None):
    raise ValueError("the student's own failure")


def test_a_failure_of_the_students_code_is_reported_not_restarted():
    with pytest.raises(AssertionError) as info:
        lab10.check_train_resumable(_raises)
    text = str(info.value)
    assert "the student's own failure" in text and "run 1" in text and "run 2" not in text, text


def test_a_restart_answer_judged_again_needs_every_ranks_part():
    """The judge reads the answer as filed: one that drops a rank, or is nothing, is a problem, never a pass."""
    case = train_resumable.cases(hidden=False)[0]
    assert "ranks answered" in train_resumable.verdict(case, {"ranks": [], "killed": 0})
    assert train_resumable.verdict(case, None)
