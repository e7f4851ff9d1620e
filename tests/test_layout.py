"""The package's layout rules, read from the code itself (imports inside functions included).

* no import cycle between minidist modules;
* every module imports only its own layer or the layers below it: the shared bottom
  (runtime, trace, models, memory, cost, units, presets) <- techniques <- harness <- checks, tour,
  benchmarks, plots, diagrams <- cli;
* library frames are recognised by package path, and the spawn entry point is named from
  the function itself (so both survive a move).
"""
import ast
import os

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "minidist")
LAYERS = {   # top-level part of minidist -> layer
    "": 0, "runtime": 0, "trace": 0, "models": 0, "memory": 0, "cost": 0, "units": 0, "presets": 0,
    "collectives": 1, "data_parallel": 1, "pipeline": 1, "tensor_parallel": 1, "context_parallel": 1, "mesh": 1,
    "overlap": 1,
    "memory_techniques": 1, "expert_parallel": 1, "checkpoint": 1,
    "harness": 2,
    "protocol": 0,
    "checks": 3, "tour": 3, "benchmarks": 3, "plots": 3, "diagrams": 3,
    "cli": 4,
}
TECHNIQUES = {part for part, layer in LAYERS.items() if layer == 1}
ABOVE_TECHNIQUES = {part for part, layer in LAYERS.items() if layer > 1}


def _modules() -> dict[str, str]:
    """module name -> file, for every .py file of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                out[name] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The deepest minidist module that ``name`` (a module or an attribute of one) lies in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: str) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):            # every import, at any depth (inside functions too)
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "minidist"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parent = parts if is_package else parts[:-1]
                parent = parent[:len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "minidist":
                continue
            for alias in node.names:       # `from minidist import trace` imports the module trace
                found.add(_resolve(f"{base}.{alias.name}"))
    found.discard(module)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_layer():
    assert {_part(m) for m in MODULES} <= set(LAYERS), sorted({_part(m) for m in MODULES} - set(LAYERS))


def test_no_import_cycle():
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_import_only_downwards():
    upward = [f"{m} ({_part(m) or 'minidist'}, layer {LAYERS[_part(m)]}) imports {n} "
              f"({_part(n) or 'minidist'}, layer {LAYERS[_part(n)]})"
              for m, deps in GRAPH.items() for n in deps if LAYERS[_part(n)] > LAYERS[_part(m)]]
    assert not upward, "\n".join(sorted(upward))


def test_techniques_never_import_checks_tour_harness_benchmarks_plots_or_cli():
    bad = [f"{m} imports {n}" for m, deps in GRAPH.items() if _part(m) in TECHNIQUES
           for n in deps if _part(n) in ABOVE_TECHNIQUES]
    assert not bad, "\n".join(sorted(bad))


def test_the_graph_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from minidist.checks.kit import launch as common\n    import minidist.tour\n")
    assert _imports("minidist.collectives.x", str(path)) == {"minidist.checks.kit.launch", "minidist.tour"}


def test_library_frames_are_recognised_by_package_path():
    from minidist.runtime.rank_process import is_library_frame
    hidden = ["runtime/launcher.py", "runtime/rank_process.py", "trace.py", "checks/kit/launch.py",
              "checks/lab1_collectives.py", "harness/data_parallel.py"]
    shown = ["collectives/allreduce.py", "data_parallel/zero.py", "pipeline/executor.py", "models.py"]
    for rel in hidden:
        assert is_library_frame(os.path.join(PACKAGE, rel)), rel
    for rel in shown:
        assert not is_library_frame(os.path.join(PACKAGE, rel)), rel
    assert not is_library_frame("/home/student/checks_mine.py")     # a student's file named like ours


@pytest.mark.parametrize("name", ["minidist.runtime.rank_process"])
def test_spawn_entry_point_is_importable_as_the_launcher_names_it(name):
    import subprocess
    import sys
    from minidist.runtime.rank_process import spawn_entry
    assert spawn_entry.__module__ == name
    code = f"from {spawn_entry.__module__} import {spawn_entry.__name__}; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
