"""Lab 9's checks refuse minidist's own expert parallelism, stand thin adapters over the library in
for the notebook's other functions, and reject a bug on the property that shows it. (The bug bank and
the correct alternatives are in solutions/lab9_expert_parallel/bugbank.py, run by the selftest.) The
placeholders below stand for the notebook's other functions, which the checks replace inside the
ranks. An adapter given, or pasted into a notebook cell, as the answer for the function it stands in
for earns nothing; the checks' package holds no other function named like one of the lab's."""
import ast
import inspect
from pathlib import Path

import pytest
import torch

from minidist.checks import lab9_expert_parallel as lab9
from minidist.checks.lab9_expert_parallel import stand_ins

ROOT = Path(__file__).resolve().parents[1]

REFUSED = "called minidist's own implementation"


def top_k_router(logits, k, capacity_factor=None):          # stood in by an adapter over the library
    raise NotImplementedError


def load_balancing_loss(router_probs, expert_indices, num_experts):
    raise NotImplementedError


def ep_dispatch(tokens, expert_indices, num_experts, group=None):
    raise NotImplementedError


def ep_combine(expert_outputs, weights, route, group=None):
    raise NotImplementedError


def moe_on_the_notebooks_functions(x, router_weight, experts, k, group=None, capacity_factor=None):
    import torch.distributed as dist
    e = dist.get_world_size(group)
    if router_weight.size(0) != x.size(1) or router_weight.size(1) % e or len(experts) != router_weight.size(1) // e:
        raise ValueError("sizes")
    logits = x @ router_weight
    idx, w, keep = top_k_router(logits, k, capacity_factor)
    rows, route = ep_dispatch(x, idx.masked_fill(~keep, -1), router_weight.size(1), group)
    outs = [ex(c) for ex, c in zip(experts, rows.split(route.recv_counts.sum(0).tolist()))]
    return ep_combine(torch.cat(outs), w, route, group), load_balancing_loss(logits.softmax(-1), idx, logits.size(1))


def router_from_library(logits, k, capacity_factor=None):
    from minidist.expert_parallel import top_k_router as library
    r = library(logits, k, capacity_factor)
    return r.indices, r.weights, r.mask


def moe_from_library(x, router_weight, experts, k, group=None, capacity_factor=None):
    from minidist.expert_parallel import moe_layer
    return moe_layer(x, router_weight.t(), experts, k, capacity_factor, group=group)


def router_without_renormalising(logits, k, capacity_factor=None):
    top, idx = logits.softmax(-1).topk(k)
    return idx, top, torch.ones_like(idx, dtype=torch.bool)


def test_lab9_refuses_the_library_and_stands_it_in_for_the_other_functions():
    with pytest.raises(AssertionError, match=REFUSED) as info:
        lab9.check_top_k_router(router_from_library)
    assert "minidist.expert_parallel" in str(info.value)
    with pytest.raises(AssertionError, match=REFUSED):
        lab9.check_moe_layer(moe_from_library)
    with pytest.raises(AssertionError, match="weights differs from the reference"):
        lab9.check_top_k_router(router_without_renormalising)
    # a layer written on the notebook's unfinished functions passes: the adapters stand in inside the ranks
    lab9.check_moe_layer(moe_on_the_notebooks_functions)


def router_with_an_integer_keep(logits, k, capacity_factor=None):
    top, idx = logits.softmax(-1).topk(k)
    return idx, top / top.sum(-1, keepdim=True), torch.ones_like(idx)


def router_scribbling_on_the_callers_logits(logits, k, capacity_factor=None):
    top, idx = logits.softmax(-1).topk(k)
    logits.data[0, 0] += 1.0            # after use: the results are right, the caller's tensor is not
    return idx, top / top.sum(-1, keepdim=True), torch.ones_like(idx, dtype=torch.bool)


def test_lab9_compares_with_the_kits_one_comparison():
    with pytest.raises(AssertionError, match="keep is int64, expected bool"):
        lab9.check_top_k_router(router_with_an_integer_keep)
    with pytest.raises(AssertionError, match="the caller's logits changed during the call"):
        lab9.check_top_k_router(router_scribbling_on_the_callers_logits)


# ------------------------------------------------------------------ the stand-ins are no answers
ADAPTED = ("top_k_router", "load_balancing_loss", "ep_dispatch", "ep_combine")


def _pasted() -> dict:
    """stand_ins.py compiled as a notebook cell, imports and all: what a student who pasted it has."""
    source = Path(stand_ins.__file__).read_text()
    cell: dict = {}
    exec(compile(source, "<cell 7>", "exec"), cell)
    return cell


@pytest.mark.parametrize("name", ADAPTED)
def test_a_stand_in_given_or_pasted_as_its_own_answer_earns_nothing(name):
    called, pasted = stand_ins.STAND_INS.table[name][0], _pasted()[name]
    assert called.__name__ == pasted.__name__ == name and called is not pasted
    for answer in (called, pasted):
        with pytest.raises(AssertionError, match=REFUSED) as info:
            getattr(lab9, f"check_{name}")(answer)
        assert "minidist.expert_parallel" in str(info.value)


def dispatch_on_the_librarys_exchange(tokens, expert_indices, num_experts, group=None):
    """The solution's dispatch with minidist's exchange of rows: dispatch's own cell, refused in its test."""
    import torch.distributed as dist
    from minidist.expert_parallel import all_to_all_rows
    e = dist.get_world_size(group)
    k, flat = expert_indices.size(1), expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] >= 0]
    send_counts = torch.bincount(flat[order], minlength=num_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(e, num_experts // e)
    rows = all_to_all_rows(tokens[order // k], send_counts.view(e, -1).sum(1).tolist(), recv_counts.sum(1).tolist(),
                           group)
    return rows, lab9.Route(order, send_counts, recv_counts)


def test_each_test_allows_only_the_library_code_of_the_stand_ins_its_function_calls():
    allow = {name: check.refusal.allow for name, check in lab9.FUNCTIONS.items()}
    assert allow["ep_dispatch"] == allow["top_k_router"] == ()
    assert set(allow["ep_combine"]) == {"minidist.expert_parallel.exchange.all_to_all_rows",
                                        "minidist.expert_parallel.exchange.AllToAllRows"}
    for name in stand_ins.CALLS:           # never the graded function's own library code
        assert not [a for a in allow[name] if a.endswith("." + name)], name
    assert not [a for a in allow["moe_layer"] if ".layer." in a]
    with pytest.raises(AssertionError, match=REFUSED + ": minidist.expert_parallel.exchange"):
        lab9.check_ep_dispatch(dispatch_on_the_librarys_exchange)


def _exercise_names() -> set:
    """Every function and class the solution notebook's answer cells define (the lab's exercises)."""
    from autograder.course.cells import nbg, read_nb, strip_solution_markers
    nb = read_nb(ROOT / "solutions/lab9_expert_parallel/lab9_expert_parallel.ipynb")
    names = set()
    for cell in nb.cells:
        if cell.cell_type == "code" and nbg(cell).get("solution"):
            tree = ast.parse(strip_solution_markers(cell.source))
            names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


def test_the_checks_define_no_exercise_but_thin_adapters_over_the_library():
    exercises = _exercise_names()
    assert {"top_k_router", "load_balancing_loss", "ep_dispatch", "ep_combine", "moe_layer",
            "AllToAllRows", "all_to_all_rows"} <= exercises
    package = Path(lab9.__file__).parent
    assert not (package / "reference.py").exists()
    found = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        library = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").startswith("minidist.expert_parallel") for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in exercises:
                calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
                into_library = [c for c in calls if isinstance(c.func, ast.Attribute)
                                and isinstance(c.func.value, ast.Name) and c.func.value.id in library]
                thin = isinstance(node, ast.FunctionDef) and len(node.body) <= 2 and into_library
                assert thin, f"{path.name} defines {node.name}, named like the lab's exercise, and it is no thin adapter"
                found[node.name] = path.name
    assert found == {name: "stand_ins.py" for name in ADAPTED}, found
    assert inspect.getmodule(stand_ins.STAND_INS.table["AllToAllRows"][0]).__name__ == "minidist.expert_parallel.exchange"
