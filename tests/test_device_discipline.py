"""Every public entry point of the library, and every tour row, runs as on a GPU rank: inputs on
``cpu``, torch's default device ``meta`` (see tests/device_discipline.py). A new public name that
no case file covers (nor exempts, with a reason) fails :func:`test_every_public_entry_point_is_covered`."""
from __future__ import annotations

import importlib
import inspect
from collections import defaultdict

import pytest

import minidist
from device_discipline import meta_default_in_ranks, run_bodies

CASE_FILES = ["device_cases_a", "device_cases_b", "device_cases_memory", "device_cases_expert",
              "device_cases_overlap"]

# Packages whose public names are the library's entry points: each package's __all__, and the
# public functions and classes defined in the modules that have none.
PACKAGES = ["minidist.collectives", "minidist.data_parallel", "minidist.pipeline", "minidist.tensor_parallel",
            "minidist.context_parallel", "minidist.mesh", "minidist.memory", "minidist.runtime",
            "minidist.memory_techniques", "minidist.expert_parallel", "minidist.overlap"]
MODULES = ["minidist.models", "minidist.harness.data_parallel", "minidist.harness.pipeline",
           "minidist.harness.parallel3d", "minidist.harness.expert_parallel"]


def public_entry_points() -> set[str]:
    names = set()
    for pkg in PACKAGES:
        module = importlib.import_module(pkg)
        names |= {f"{pkg}.{n}" for n in module.__all__}
    for mod in MODULES:
        module = importlib.import_module(mod)
        names |= {f"{mod}.{n}" for n, obj in vars(module).items()
                  if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                  and obj.__module__ == mod}
    return names


def load_cases():
    cases, exempt = {}, {}
    for name in CASE_FILES:
        module = importlib.import_module(name)
        overlap = (set(cases) | set(exempt)) & (set(module.CASES) | set(module.EXEMPT))
        assert not overlap, f"{name} covers names another case file covers too: {sorted(overlap)}"
        cases.update(module.CASES)
        exempt.update(module.EXEMPT)
    return cases, exempt


def test_every_public_entry_point_is_covered():
    cases, exempt = load_cases()
    missing = sorted(public_entry_points() - set(cases) - set(exempt))
    assert not missing, (f"{len(missing)} public entry point(s) have no device-discipline case "
                         f"(add one to a tests/device_cases_*.py file, or exempt it with the reason): {missing}")
    stale = sorted((set(cases) | set(exempt)) - public_entry_points())
    assert not stale, f"cases name entry points that no longer exist: {stale}"
    assert all(why.strip() for why in exempt.values())


def _rank_bodies(names):
    cases, _ = load_cases()
    return run_bodies({n: cases[n].body for n in names})


@pytest.mark.parametrize("case_file", CASE_FILES)
def test_entry_points_run_with_meta_default_device(case_file):
    cases = importlib.import_module(case_file).CASES
    by_size = defaultdict(list)
    for name, case in cases.items():
        by_size[case.world_size].append(name)
    failures = {}
    with meta_default_in_ranks():
        for world_size, names in sorted(by_size.items()):
            for rank, failed in enumerate(minidist.launch(_rank_bodies, world_size, names, timeout=120)):
                for name, tb in failed.items():
                    failures.setdefault(name, f"rank {rank}:\n{tb}")
    assert not failures, "made a tensor off the inputs' device:\n" + "\n".join(
        f"- {n}: {tb}" for n, tb in sorted(failures.items()))


def test_every_tour_row_runs_with_meta_default_device():
    """The whole tour (``make demo``), each rank with ``meta`` as its default device."""
    from minidist.tour import run_tour
    with meta_default_in_ranks():
        rows = run_tour()
    failed = [r for r in rows if not r["passed"]]
    assert rows and not failed, "\n".join(f"- {r['technique']}: {r.get('note')}" for r in failed)
