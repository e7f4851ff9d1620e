"""The confirmation's judge: every test's verdict given again by a process that never ran student code
(minidist/checks/kit/check.py, autograder/confirm/judge.py), and failing closed.

The child that runs a submission's cells files the student's answers as plain data; the judge resolves
each call of the test cell through the lab's registry of checks, takes the cases from the pristine
checks, computes the references and gives each verdict again. A solution cell that rewrites a check's
verdict inside the child (where it runs next to the check), or hides the answers, no longer passes the
confirmation, while honest answers do; a test cell the judge cannot resolve earns nothing."""
import glob
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

from minidist.checks import toylab
from minidist.checks.kit import docket
from minidist.checks.kit.check import Registry
from minidist.checks.kit.run import RankCase, run
from minidist.runtime import plain_data

ROOT = Path(__file__).resolve().parents[1]
from autograder.confirm import judge as confirm_judge  # noqa: E402

ADD = toylab.ADD
VISIBLE, HIDDEN = dict(hidden=False), dict(hidden=True)
MODULES = {"checks": "minidist.checks.toylab"}


def entries(answers, params=VISIBLE, check=ADD):
    return [(check.key, docket.params_key(params), i, plain_data.dumps(a)) for i, a in enumerate(answers)]


def right_answers(hidden=False):
    return [sum(case["args"]) for case in ADD.cases(hidden=hidden)]


def test_the_judge_passes_right_answers_and_fails_a_wrong_one():
    assert ADD.judge(HIDDEN, entries(right_answers(True), HIDDEN)) is None
    wrong = right_answers(True)
    wrong[1] += 1
    assert ADD.judge(HIDDEN, entries(wrong, HIDDEN)) == "add(10, -3) returned 8; expected 7"


def test_a_case_with_no_answer_filed_fails():
    problem = ADD.judge(HIDDEN, entries(right_answers(True), HIDDEN)[:-1])
    assert "no answer was filed for 1 of its 3 cases" in problem
    # the visible call's answers do not answer the hidden call's cases
    assert "no answer was filed" in ADD.judge(HIDDEN, entries(right_answers()))


def test_answers_that_are_not_plain_data_fail():
    bad = entries(right_answers(True), HIDDEN)
    bad[0] = (bad[0][0], bad[0][1], 0, b'{"pickle": "cos\\nsystem"}')
    assert "not plain data" in ADD.judge(HIDDEN, bad)
    bad[0] = (bad[0][0], bad[0][1], 99, bad[1][3])
    assert "malformed" in ADD.judge(HIDDEN, bad)


def test_the_judge_resolves_a_test_cells_calls_through_the_labs_registry():
    modules = confirm_judge.checks_modules(["import torch\nfrom minidist.checks import toylab as checks\n"])
    assert modules == MODULES
    both = entries(right_answers()) + entries(right_answers(True), HIDDEN)
    cell = "checks.check_add(add)\n### BEGIN HIDDEN TESTS\nchecks.check_add(add, hidden=True)\n### END HIDDEN TESTS\n"
    problem, judged = confirm_judge.verdict(cell, MODULES, both)
    assert problem is None and judged == [ADD.key, ADD.key]
    assert "no answer was filed" in confirm_judge.verdict(cell, MODULES, entries(right_answers()))[0]
    # one statement that is not a check's call, anywhere in the cell, and the test cannot be confirmed
    problem, _ = confirm_judge.verdict(cell + "add = None\n", MODULES, both)
    assert problem == "the judge cannot confirm this test: line 5 of the test cell is not a call of a check (add = None)"


@pytest.mark.parametrize("cell, says", [
    ("assert add(1, 2) == 3", "line 1 of the test cell is not a call of a check"),
    ("checks.check_add(add, hidden=h)", "does not give hidden as a constant"),
    ("checks.check_add(add, **options)", "unpacks its arguments"),
    ("checks.measure(add)", "measure is not one of minidist.checks.toylab's registered checks"),
    ("checks.check_add(add, 1, 2, 3)", "does not fit the check"),
    ("print('all good')", "not a call of a check"),
    ("# only a comment", "its cell calls no check"),
    ("other.check_add(add)", "not a call of a check"),
])
def test_a_test_cell_the_judge_cannot_resolve_is_not_confirmed(cell, says):
    problem, _ = confirm_judge.verdict(cell, MODULES, entries(right_answers()))
    assert problem.startswith("the judge cannot confirm this test") and says in problem, problem


def _test_cells():
    """(lab, test id, source, the lab's checks modules) of every test cell of every lab, and the fixture's."""
    from autograder.confirm.start import plan
    out = []
    for path in sorted(glob.glob(str(ROOT / "solutions/*/*.ipynb"))) + [
            str(ROOT / "tests/fixtures/course/solutions/toylab/toylab.ipynb")]:
        nb = nbformat.read(path, 4)
        cells = plan(nb, nb)
        modules = confirm_judge.checks_modules([c["source"] for c in cells if c["kind"] in ("setup", "given")])
        out += [(Path(path).stem, c["id"], c["source"], modules) for c in cells if c["kind"] == "test"]
    return out


@pytest.mark.parametrize("lab, test, source, modules", _test_cells(), ids=[f"{c[0]}-{c[1]}" for c in _test_cells()])
def test_every_test_cell_of_every_lab_resolves_through_its_registry(lab, test, source, modules):
    """Static, over solutions/: every call of every test cell is a registered check with constant params,
    so an honest submission is never left unconfirmed by the judge."""
    calls = confirm_judge.test_calls(source, modules)
    assert calls, f"{lab}/{test} calls no check"
    for module, name, args, kwargs in calls:
        for check, params in confirm_judge.resolve(module, name, args, kwargs):
            assert check.key.startswith(module + ".") and set(params) == set(check.params)


def test_the_check_files_its_answers_only_where_asked(monkeypatch):
    monkeypatch.setattr(docket, "_entries", [])
    toylab.check_add(lambda a, b: a + b, hidden=True)
    assert docket.entries() == []                           # a notebook's run files nothing
    monkeypatch.setattr(docket, "ON", True)
    toylab.check_add(lambda a, b: a + b, hidden=True)
    assert ADD.judge(HIDDEN, docket.entries()) is None


def test_a_full_docket_says_so_and_counts_afresh_once_emptied(monkeypatch):
    monkeypatch.setattr(docket, "ON", True)
    monkeypatch.setattr(docket, "_entries", [])
    monkeypatch.setattr(docket, "MAX_BYTES", 100)
    answer = plain_data.dumps(list(range(20)))                      # 60-odd bytes
    assert docket.file(ADD.key, VISIBLE, 0, answer, "add") is None
    assert "more than the 0 MiB the grader keeps" in docket.file(ADD.key, VISIBLE, 1, answer, "add")
    assert len(docket.entries()) == 1                               # the second was not filed
    del docket.entries()[:]                                         # what the runner does before a test
    assert docket.file(ADD.key, VISIBLE, 1, answer, "add") is None


# ----------------------------------------------------------------------------- a check on groups of ranks
def _group_answer(fn, case, on):
    return {"r": on.r, "t": on.t, "got": fn(on.r)}


def _group_verdict(item: RankCase, answer):
    if (answer["r"], answer["t"]) != (item.r, item.t):
        return f"answered as rank {answer['r']} of {answer['t']}"
    return None if answer["got"] == item.r * 10 else f"got {answer['got']}, expected {item.r * 10}"


GROUPS = Registry(__name__).check("times ten", lambda hidden: [dict(t=4), dict(t=3), dict(t=1)], _group_answer,
                                  _group_verdict, where="groups", world=4)


def test_answers_from_the_ranks_are_indexed_by_case_and_world_rank(monkeypatch):
    got = [(i, rank, r, t) for i, (case, rank, r, t, _) in enumerate(GROUPS.judged_cases(VISIBLE))]
    assert got == [(0, 0, 0, 4), (1, 1, 1, 4), (2, 2, 2, 4), (3, 3, 3, 4),
                   (4, 0, 0, 3), (5, 1, 1, 3), (6, 2, 2, 3), (7, 3, 0, 1),       # t = 3 on 4 ranks leaves one of 1
                   (8, 0, 0, 1), (9, 1, 0, 1), (10, 2, 0, 1), (11, 3, 0, 1)]
    monkeypatch.setattr(docket, "ON", True)
    monkeypatch.setattr(docket, "_entries", [])
    run(GROUPS, lambda r: 10 * r, hidden=False)          # 4 ranks, every case, filed by world rank
    honest = list(docket.entries())
    assert [e[2] for e in honest] == list(range(12)) and GROUPS.judge(VISIBLE, honest) is None
    key, pk, index, data = honest[5]
    forged = honest[:5] + [(key, pk, index, plain_data.dumps({**plain_data.loads(data), "got": 0}))] + honest[6:]
    assert GROUPS.judge(VISIBLE, forged) == "times ten (t=3, default sizes), rank 1 (rank 1 of its group): got 0, expected 10"
    with pytest.raises(AssertionError, match=r"times ten \(t=4, default sizes\), rank 2 \(rank 2 of its group\): got 0"):
        run(GROUPS, lambda r: 10 * r if r != 2 else 0, hidden=False)


# ----------------------------------------------------------------------------- end to end
REWRITES_THE_VERDICT = '''
object.__setattr__(checks.ADD, "verdict", lambda case, answer: None)    # the check's own verdict, in this process
def add(a, b):
    return 0
'''
HIDES_THE_ANSWERS = '''
import minidist.checks.kit.docket as docket
object.__setattr__(checks.ADD, "verdict", lambda case, answer: None)
filed, calls = docket._entries, []
def add(a, b):
    calls.append(1)
    docket._entries = [] if len(calls) < 3 else filed     # the answers filed where the runner does not look
    return 0 if len(calls) < 3 else a + b                 # (but the last, a right one: nothing is left rebound)
'''


def confirm_one(tmp_path, nb_path: Path, cell: str, solution=None, test=None) -> dict:
    """A confirmation of a lab's setup cells, its graded ``cell`` (the solution's, or ``solution``) and
    ``cell``'s test (or ``test`` as its source), without a sandbox; the test's outcome as the parent
    reports it."""
    from autograder.confirm.start import Confirmation, copy_pristine, plan
    nb = nbformat.read(nb_path, 4)
    cells = [c for c in plan(nb, nb) if c["kind"] in ("setup", "given") or c["id"] in (cell, f"test_{cell}")]
    if solution is not None:
        next(c for c in cells if c["id"] == cell)["source"] = solution
    if test is not None:
        next(c for c in cells if c["id"] == f"test_{cell}")["source"] = test
    run_ = Confirmation(cells, pristine=copy_pristine(tmp_path / "pristine"), workdir=tmp_path / "work",
                        sandbox=None, env=dict(os.environ), timeout=240, cell_timeout=120, log=tmp_path / "log")
    run_.wait()
    results = run_.results()
    assert results["done"], (tmp_path / "log").read_text()[-3000:]
    return results["tests"][f"test_{cell}"]


TOYLAB = ROOT / "tests/fixtures/course/solutions/toylab/toylab.ipynb"


def test_an_honest_answer_is_confirmed_by_the_judge(tmp_path):
    assert confirm_one(tmp_path, TOYLAB, "add")["error"] is None


@pytest.mark.parametrize("attack, says", [
    (REWRITES_THE_VERDICT, "add(1, 2) returned 0; expected 3"),
    (HIDES_THE_ANSWERS, "no answer was filed for 1 of its 1 cases")])
def test_a_verdict_rewritten_in_the_child_is_not_confirmed(tmp_path, attack, says):
    # with the child's word alone (the parent without its judge) both pass the test with every answer 0
    error = confirm_one(tmp_path, TOYLAB, "add", attack)["error"]
    assert error is not None and says in error[1] and "a process that ran no student code" in error[1], error


def test_a_test_cell_the_judge_cannot_resolve_is_unconfirmed_and_scores_zero(tmp_path):
    """The child runs a test cell written as a plain assert (it passes there); the judge cannot resolve
    it, so the test is not confirmed and the confirmation gives it 0 points."""
    from autograder.confirm.points import confirmed_points
    outcome = confirm_one(tmp_path, TOYLAB, "add", test="assert add(1, 2) == 3\n")
    assert outcome["error"][1].startswith("the judge cannot confirm this test: line 1"), outcome
    assert confirmed_points(outcome, 1.0)[0] == 0.0


def test_an_honest_answer_on_ranks_is_confirmed_by_the_judge(tmp_path):
    # every rank's answers of a launched check, filed by the child and judged again
    assert confirm_one(tmp_path, TOYLAB, "allsum")["error"] is None


def test_the_judge_sees_json_params_as_the_check_files_them():
    # a tuple param (lab 1's world_sizes) reaches the docket as a list: the judge keys it the same way
    assert docket.params_key({"world_sizes": (3, 6)}) == json.dumps({"world_sizes": [3, 6]})
