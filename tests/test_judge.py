"""The confirmation's judge: a pure check's verdict given again by a process that never ran student
code (minidist/checks/docket.py, autograder/confirm_judge.py; issue 27, item 2).

The child that runs a submission's cells files the student's answers as plain data; the judge takes
the cases from the pristine checks, computes the references and gives each verdict again. So a
solution cell that rewrites a check's verdict inside the child (where it runs next to the check),
or hides the answers, no longer passes the confirmation, while honest answers do."""
import os
import sys
from pathlib import Path

import nbformat
import pytest

from minidist.checks import docket
from minidist.checks import lab7_3d_parallel as lab7
from minidist.cost.parallel3d import stage_numel
from minidist.runtime import plain_data

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "autograder"))
import confirm_judge  # noqa: E402

STAGES = lab7.JUDGED_STAGES
VISIBLE = dict(hidden=False)


def entries(answers, params=VISIBLE, judged=STAGES):
    return [(judged.key, docket._params_key(params), i, plain_data.dumps(a)) for i, a in enumerate(answers)]


def right_answers(hidden=False):
    return [stage_numel(*case) for case in STAGES.cases(hidden=hidden)]


def test_the_judge_passes_right_answers_and_fails_a_wrong_one():
    assert STAGES.judge(VISIBLE, entries(right_answers())) is None
    wrong = right_answers()
    wrong[1] += 1
    assert "stage=1) = " in STAGES.judge(VISIBLE, entries(wrong))


def test_a_case_with_no_answer_filed_fails():
    problem = STAGES.judge(VISIBLE, entries(right_answers())[:-1])
    assert "no answer was filed for 1 of its 3 cases" in problem
    # the visible call's answers do not answer the hidden call's cases
    assert "no answer was filed" in STAGES.judge(dict(hidden=True), entries(right_answers()))


def test_answers_that_are_not_plain_data_fail():
    bad = entries(right_answers())
    bad[0] = (bad[0][0], bad[0][1], 0, b'{"pickle": "cos\\nsystem"}')
    assert "not plain data" in STAGES.judge(VISIBLE, bad)
    bad[0] = (bad[0][0], bad[0][1], 99, bad[1][3])
    assert "malformed" in STAGES.judge(VISIBLE, bad)


def test_the_judge_reads_which_checks_a_test_cell_calls_and_how():
    modules = confirm_judge.checks_modules(["from minidist.checks import lab7_3d_parallel as checks\n"], [str(ROOT)])
    assert modules["checks"][0] == "minidist.checks.lab7_3d_parallel"
    assert {"check_mesh_groups", "check_stage_parameters", "check_predict_memory"} <= modules["checks"][1]
    assert "check_train_step" not in modules["checks"][1]          # compares in the ranks: not judged (yet)
    cell = ("checks.check_stage_parameters(stage_parameters)\n"
            "checks.check_stage_parameters(stage_parameters, hidden=True)\n"
            "checks.check_train_step(train_step_3d)\n")
    calls = confirm_judge.judged_calls(cell, modules)
    assert [(c[1], c[3].get("hidden")) for c in calls] == [("check_stage_parameters", None),
                                                           ("check_stage_parameters", True)]
    both = entries(right_answers()) + entries(right_answers(True), dict(hidden=True))
    assert confirm_judge.verdict(calls, both) is None
    assert "no answer was filed" in confirm_judge.verdict(calls, entries(right_answers()))
    flag = confirm_judge.judged_calls("checks.check_stage_parameters(stage_parameters, hidden=h)", modules)
    assert "does not give hidden as a constant" in confirm_judge.verdict(flag, both)


def test_the_check_files_its_answers_only_where_asked(monkeypatch):
    known = {case[1:]: stage_numel(*case) for case in STAGES.cases(hidden=False)}     # outside the graded call

    def stage_parameters(cfg, pp, tp, stage):
        return known[pp, tp, stage]
    monkeypatch.setattr(docket, "_entries", [])
    lab7.check_stage_parameters(stage_parameters)
    assert docket.entries() == []                           # a notebook's run files nothing
    monkeypatch.setattr(docket, "ON", True)
    lab7.check_stage_parameters(stage_parameters)
    assert STAGES.judge(VISIBLE, docket.entries()) is None


# ----------------------------------------------------------------------------- end to end
REWRITES_THE_VERDICT = '''
import minidist.checks.lab7_3d_parallel as lab7
lab7.JUDGED_STAGES.verdict = lambda case, answer: None     # the check's own verdict, in this process
def stage_parameters(cfg, pp, tp, stage):
    return 0
'''
HIDES_THE_ANSWERS = '''
import minidist.checks.docket as docket
import minidist.checks.lab7_3d_parallel as lab7
lab7.JUDGED_STAGES.verdict = lambda case, answer: None
filed, calls = docket._entries, []
def stage_parameters(cfg, pp, tp, stage):
    calls.append(1)
    docket._entries = [] if len(calls) < 3 else filed     # the answers filed where the runner does not look
    return 0 if len(calls) < 3 else LAST                  # (but the last, a right one: nothing is left rebound)
'''


def confirm_stage_parameters(tmp_path, solution=None) -> dict:
    """A confirmation of lab 7's setup cells, its stage_parameters cell (the solution's, or
    ``solution``) and that test, without a sandbox; the test's outcome as the parent reports it."""
    from autograder.confirm import Confirmation, copy_pristine, plan
    nb = nbformat.read(ROOT / "solutions/lab7_3d_parallel/lab7_3d_parallel.ipynb", 4)
    cells = [c for c in plan(nb, nb) if c["kind"] in ("setup", "given")
             or c["id"] in ("stage_parameters", "test_stage_parameters")]
    if solution is not None:
        next(c for c in cells if c["id"] == "stage_parameters")["source"] = solution
    run = Confirmation(cells, pristine=copy_pristine(tmp_path / "pristine"), workdir=tmp_path / "work", sandbox=None,
                       env=dict(os.environ), timeout=240, cell_timeout=120, log=tmp_path / "log")
    run.wait()
    results = run.results()
    assert results["done"], (tmp_path / "log").read_text()[-3000:]
    return results["tests"]["test_stage_parameters"]


def test_an_honest_answer_is_confirmed_by_the_judge(tmp_path):
    assert confirm_stage_parameters(tmp_path)["error"] is None


@pytest.mark.parametrize("attack, says", [
    (REWRITES_THE_VERDICT, "= 0, expected"),
    (HIDES_THE_ANSWERS.replace("LAST", str(stage_numel(*STAGES.cases(hidden=False)[2]))),
     "no answer was filed for 2 of its 3 cases")])
def test_a_verdict_rewritten_in_the_child_is_not_confirmed(tmp_path, attack, says):
    # with the child's word alone (the parent without its judge) both pass the test with every answer 0
    error = confirm_stage_parameters(tmp_path, attack)["error"]
    assert error is not None and says in error[1] and "a process that ran no student code" in error[1]
