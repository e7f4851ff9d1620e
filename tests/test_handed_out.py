"""What leaves the instructor's machine holds no answer (issue 58).

* The grading files a platform's bundle carries for each lab (``autograder.handout.platforms.bundle.grading_files``):
  the lab's source notebook with its solutions emptied, from which nbgrader makes exactly the release in
  ``labs/`` (checked for every lab), and no solution body; the hidden tables of the checks it imports.
* The Gradescope zip and the PrairieLearn image, built (``make test-e2e``): no solution body and no function
  named like an exercise outside the library's refused implementation or a thin adapter over it
  (:mod:`handed_out`), no hidden case table in what a job reads (the wheel), no bug bank (no bank's file, no
  entry's name or code; nor in the grading files, checked by ``make test``).
* A function of the library that answers an exercise of labs 3, 9, 10 and 11, pasted into the release's cell,
  is flagged by the similarity report against minidist (calling it is refused: the labs' own tests).

The student distribution is searched the same way in ``test_student_dist.py``.
"""
from __future__ import annotations

import ast
import inspect
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder.course.cells import grade_id, read_nb
from autograder.course.labs import all_labs, labs_dir, solutions_dir
from autograder.course.template import build_course
from handed_out import bank_files, bank_in, exercises_defined_in, files, public_lines, solution_bodies, solutions_in

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def grading(tmp_path_factory):
    """Every lab's grading files, as a bundle carries them."""
    from autograder.handout.platforms.bundle import grading_files
    course = tmp_path_factory.mktemp("grading") / "course"
    for lab in all_labs():
        grading_files(lab, course)
    return course


def test_the_grading_files_hold_no_solution(grading):
    assert len(solution_bodies()) > 40                     # every lab's regions of three lines or more
    assert solutions_in(grading) == []
    assert sorted(p.name for p in (grading / "solutions").iterdir()) == all_labs()
    for lab in all_labs():          # the lab's hidden cases, which the bundle's grader alone reads
        assert (grading / "hidden" / lab / "hidden.py").read_text() == \
            (ROOT / "minidist" / "checks" / lab / "hidden.py").read_text()


def test_the_grading_files_hold_no_bug_bank(grading):
    """Every lab's bank sits beside its solution; none of it is in the files a bundle's grader reads."""
    assert [p.parent.name for p in bank_files()] == all_labs()
    assert bank_in(grading, public_lines()) == []


@pytest.mark.e2e
def test_nbgrader_makes_the_same_release_from_the_grading_files(grading, tmp_path):
    """The notebook without solutions is the source a bundle's grader builds its course from: the release and
    the gradebook's cells (their checksums) must be the ones students got."""
    course = build_course(all_labs(), tmp_path / "course", solutions=grading / "solutions")
    for lab in all_labs():
        for path in sorted((labs_dir() / lab).glob("*.ipynb")):
            ours, theirs = read_nb(course / "release" / lab / path.name), read_nb(path)
            assert [(c.cell_type, c.source, c.metadata) for c in ours.cells] == \
                   [(c.cell_type, c.source, c.metadata) for c in theirs.cells], f"{lab}/{path.name}"


@pytest.mark.e2e
@pytest.mark.parametrize("platform, lab", [("gradescope", "lab3_zero_fsdp"), ("prairielearn", "lab9_expert_parallel")])
def test_a_platform_bundle_holds_no_answer(platform, lab, tmp_path):
    from autograder.handout.platforms import gradescope, prairielearn
    if platform == "gradescope":
        built = gradescope.build(lab, tmp_path / "out")
    else:
        built = prairielearn.build(lab, tmp_path / "out", image="minidist-test/grader", timeout=600) / "grader-image"
    folder = built.parent if built.suffix == ".zip" else built
    assert solutions_in(folder) == []
    assert exercises_defined_in(folder) == []
    members = files(folder)
    wheel = [m for m in members if ".whl/" in m]
    assert wheel and not [m for m in wheel if m.endswith("hidden.py") or ("/checks/" in m and m.endswith("reference.py"))]
    assert not [m for m in members if "/bugbank/" in m]
    assert bank_in(folder, public_lines()) == []
    assert [m for m in members if m.endswith(f"hidden/{lab}/hidden.py")]      # the grader's: course/, root's alone


#: per lab, what its library offers that would answer one of its exercises: (module, function, the cell it
#: would answer); a student pastes it with whatever adapts it to the notebook's signature (lab 3's stand-ins:
#: the same lines). Lab 3's free_parameters is one line every answer writes alike (its library line too):
#: calling it is refused, and no fingerprint tells a copy of one line.
LIBRARY_ANSWERS = {
    "lab3_zero_fsdp": [("minidist.data_parallel.shard_ops", "reduce_scatter_grads", "reduce_scatter_gradients"),
                       ("minidist.data_parallel.shard_ops", "step_and_gather", "sharded_step"),
                       ("minidist.data_parallel.shard_ops", "gather_flat", "gather_parameters")],
    "lab9_expert_parallel": [],       # filled from the library's names (its exercises' names), below
    "lab10_checkpointing": [("minidist.checkpoint.portable", "save_portable", "save_sharded"),
                            ("minidist.checkpoint.portable", "load_portable", "load_resharded")],
    "lab11_overlap": [],              # filled from the library's names (minidist.overlap's rings), below
}
ADAPTERS = {"lab3_zero_fsdp": "minidist.checks.lab3_zero_fsdp.stand_ins"}


def _library_answers(lab: str) -> list[tuple[str, str, str]]:
    """LIBRARY_ANSWERS, with every function of the lab's refused library named like one of its exercises."""
    import importlib

    from handed_out import exercises, library_of
    out = list(LIBRARY_ANSWERS[lab])
    names = exercises()[lab]
    for path in sorted((ROOT / "minidist").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in names and library_of(lab, module, node.name):
                out.append((module, node.name, node.name))
    return [entry for entry in out if getattr(importlib.import_module(entry[0]), entry[1], None) is not None]


@pytest.mark.parametrize("lab", sorted(LIBRARY_ANSWERS))
def test_a_pasted_library_answer_is_flagged(lab):
    """Pasted under the exercise's name in place of the released cell, each such function scores at least the
    threshold against minidist (what the release gives in the cell does not count)."""
    import importlib

    from autograder.reports.similarity import Text, THRESHOLD, compare, library_text
    path = next((solutions_dir() / lab).glob("*.ipynb"))
    released = {grade_id(c): c.source for c in read_nb(labs_dir() / lab / path.name).cells if grade_id(c)}
    found = _library_answers(lab)
    assert found, f"{lab}: nothing of the library answers an exercise: the test would prove nothing"
    for module, name, cell in found:
        fn = getattr(importlib.import_module(module), name)
        source = inspect.getsource(fn)
        if lab in ADAPTERS:
            source += "\n\n" + inspect.getsource(getattr(importlib.import_module(ADAPTERS[lab]), cell))
        else:
            source = source.replace(f"def {name}(", f"def {cell}(", 1)
        stub = released.get(cell, "")
        answer = Text("student", lab, path.stem, cell, source)
        score = compare(answer, library_text(), stub, f"{lab}/{cell}").score
        assert score >= THRESHOLD, f"{module}.{name} pasted as {cell}: {score:.2f} against minidist"


def test_lab4s_gradescope_results_show_every_visible_test_before_the_due_date():
    """Lab 4's test cells, as Gradescope lists them: each cell's visible part is a test shown at once, its
    hidden part (where it has one) a test shown after the due date, their points adding up to the cell's."""
    from autograder.handout.platforms.graded import Outcome, test_cells
    from autograder.handout.platforms.gradescope import results_json
    lab = "lab4_pipeline"
    tests = test_cells(lab)
    data = results_json(Outcome(lab, tests))
    cells = {t.name: t for t in tests if not t.manual}
    shown = [t for t in data["tests"] if t["visibility"] == "visible"]
    later = [t for t in data["tests"] if t["visibility"] == "after_due_date"]
    assert sorted(t["name"].split(": ")[1] for t in shown) == sorted(cells)      # every test cell, at once
    assert sorted(t["name"].split(": ")[1].removesuffix(" (hidden tests)") for t in later) == \
        sorted(name for name, t in cells.items() if t.hidden)
    assert len(later) >= 3 and all(t["name"].endswith(" (hidden tests)") for t in later)
    for name, t in cells.items():
        parts = [r["max_score"] for r in data["tests"] if r["name"].split(": ")[1].removesuffix(" (hidden tests)") == name]
        assert sum(parts) == t.max_points
