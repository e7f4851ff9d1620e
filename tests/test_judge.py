"""The confirmation's judge: a check's verdict given again by a process that never ran student code
(minidist/checks/docket.py, autograder/confirm_judge.py; issue 27, item 2), whether the check
compares in the child, launches and compares every rank's results, or compared inside the ranks.

The child that runs a submission's cells files the student's answers as plain data; the judge takes
the cases from the pristine checks, computes the references and gives each verdict again. So a
solution cell that rewrites a check's verdict inside the child (where it runs next to the check),
or hides the answers, no longer passes the confirmation, while honest answers do."""
import os
import sys
from pathlib import Path

import nbformat
import pytest

from minidist.checks.kit import docket
from minidist.checks import lab7_3d_parallel as lab7
from minidist.checks.kit.groups import rank_cases
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
    assert {"check_mesh_groups", "check_stage_parameters", "check_predict_memory",
            "check_train_step"} <= modules["checks"][1]
    assert "measure" not in modules["checks"][1]                   # a demo, not a check
    cell = ("checks.check_stage_parameters(stage_parameters)\n"
            "checks.check_stage_parameters(stage_parameters, hidden=True)\n"
            "print(checks.measure(train_step_3d))\n")
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
import minidist.checks.kit.docket as docket
import minidist.checks.lab7_3d_parallel as lab7
lab7.JUDGED_STAGES.verdict = lambda case, answer: None
filed, calls = docket._entries, []
def stage_parameters(cfg, pp, tp, stage):
    calls.append(1)
    docket._entries = [] if len(calls) < 3 else filed     # the answers filed where the runner does not look
    return 0 if len(calls) < 3 else LAST                  # (but the last, a right one: nothing is left rebound)
'''


def confirm_one(tmp_path, lab: str, cell: str, solution=None, also=()) -> dict:
    """A confirmation of a lab's setup cells, its graded ``cell`` (the solution's, or ``solution``),
    the solution cells ``also`` and ``cell``'s test, without a sandbox; the test's outcome as the
    parent reports it."""
    from autograder.confirm import Confirmation, copy_pristine, plan
    nb = nbformat.read(ROOT / f"solutions/{lab}/{lab}.ipynb", 4)
    cells = [c for c in plan(nb, nb) if c["kind"] in ("setup", "given") or c["id"] in (cell, f"test_{cell}", *also)]
    if solution is not None:
        next(c for c in cells if c["id"] == cell)["source"] = solution
    run = Confirmation(cells, pristine=copy_pristine(tmp_path / "pristine"), workdir=tmp_path / "work", sandbox=None,
                       env=dict(os.environ), timeout=240, cell_timeout=120, log=tmp_path / "log")
    run.wait()
    results = run.results()
    assert results["done"], (tmp_path / "log").read_text()[-3000:]
    return results["tests"][f"test_{cell}"]


def confirm_stage_parameters(tmp_path, solution=None) -> dict:
    return confirm_one(tmp_path, "lab7_3d_parallel", "stage_parameters", solution)


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


# ----------------------------------------------------------------------------- checks that compare in the ranks
def test_answers_from_the_ranks_are_indexed_by_case_and_world_rank():
    cases = [dict(t=4), dict(t=3), dict(t=1)]
    got = [(i, rank, r, t) for i, (case, rank, r, t) in enumerate(rank_cases(cases, 4))]
    assert got == [(0, 0, 0, 4), (1, 1, 1, 4), (2, 2, 2, 4), (3, 3, 3, 4),
                   (4, 0, 0, 3), (5, 1, 1, 3), (6, 2, 2, 3), (7, 3, 0, 1),       # t = 3 on 4 ranks leaves one of 1
                   (8, 0, 0, 1), (9, 1, 0, 1), (10, 2, 0, 1), (11, 3, 0, 1)]


def test_a_full_docket_says_so_and_counts_afresh_once_emptied(monkeypatch):
    monkeypatch.setattr(docket, "ON", True)
    monkeypatch.setattr(docket, "_entries", [])
    monkeypatch.setattr(docket, "MAX_BYTES", 100)
    answer = plain_data.dumps(list(range(20)))                      # 60-odd bytes
    assert STAGES.file(VISIBLE, 0, answer) is None
    assert "more than the 0 MiB the grader keeps" in STAGES.file(VISIBLE, 1, answer)
    assert len(docket.entries()) == 1                               # the second was not filed
    del docket.entries()[:]                                         # what the runner does before a test
    assert STAGES.file(VISIBLE, 1, answer) is None


def test_the_judge_gives_every_ranks_verdict_again(monkeypatch):
    from minidist.checks import lab9_expert_parallel as lab9
    from minidist.checks import lab9_reference
    monkeypatch.setattr(docket, "ON", True)
    monkeypatch.setattr(docket, "_entries", [])
    lab9.check_function("ep_combine", lab9_reference.ep_combine)      # the answers come back from 4 ranks
    params = dict(name="ep_combine", hidden=False)
    honest = list(docket.entries())
    assert len(honest) == 2 * 4 and lab9.JUDGED.judge(params, honest) is None
    key, pk, index, data = honest[6]                 # the second case (t = 4), rank 2
    answer = plain_data.loads(data)
    answer["y"] = answer["y"] * 0
    forged = honest[:6] + [(key, pk, index, plain_data.dumps(answer))] + honest[7:]
    problem = lab9.JUDGED.judge(params, forged)
    assert problem.startswith("ep_combine (t=4, E=8, k=2, dtype=float32), rank 2 (rank 2 of its group): the output "
                              "differs from one process"), problem
    assert "no answer was filed for 1 of its 8 cases" in lab9.JUDGED.judge(params, honest[:5] + honest[6:])


def test_an_honest_rank_answer_is_confirmed_by_the_judge(tmp_path):
    # the answers of 4 ranks, filed by the child and judged again
    assert confirm_one(tmp_path, "lab9_expert_parallel", "ep_combine", also=("ep_dispatch",))["error"] is None


def test_a_check_run_here_and_on_ranks_is_judged_by_both_parts():
    from minidist.checks import lab8_memory as lab8
    assert lab8.check_function.judged == (lab8.JUDGED_HERE, lab8.JUDGED_RANKS)
    visible = dict(name="DynamicLossScaler", hidden=False)
    # 2 group sizes x 2 cases of unscale_, each answered by 4 ranks; the bookkeeping's cases here
    assert "no answer was filed for 16 of its 16 cases" in lab8.JUDGED_RANKS.judge(visible, [])
    assert "no answer was filed" in lab8.JUDGED_HERE.judge(visible, [])
    assert lab8.JUDGED_RANKS.judge(dict(name="recompute_blocks", hidden=False), []) is None   # nothing on ranks


def test_a_launched_check_is_judged_from_every_ranks_results():
    from minidist.checks import lab2_data_parallel as lab2
    from minidist.checks.kit.docket import from_raising
    run = lab2.JUDGED_AVERAGE_TRAFFIC.cases()[0]                     # (n = 2, the frozen and tied models)
    res = {"events": [["all_reduce", 4]], "numel": 1}
    assert "expected only all_reduce calls, saw ['broadcast']" in lab2.JUDGED_AVERAGE_TRAFFIC.verdict(
        run, [[{**res, "events": [["broadcast", 4]]}] * 2] * 2)
    assert "per step; expected one per trainable parameter" in lab2.JUDGED_AVERAGE_TRAFFIC.verdict(run, [[res] * 2] * 2)
    # a forged answer the comparison cannot read is a problem, never a crash of the judge
    assert "could not be judged (KeyError" in lab2.JUDGED_AVERAGE_TRAFFIC.verdict(run, [[{}] * 2] * 2)
    assert from_raising(lambda case, answer: None)(None, None) is None


def test_the_judge_finds_a_judged_check_a_checks_module_takes_from_another():
    lab3 = confirm_judge.checks_modules(["from minidist.checks import lab3_zero_fsdp as checks\n"], [str(ROOT)])
    assert {"check_zero", "check_zero_memory", "check_zero_traffic",
            "check_reduce_scatter_gradients"} <= lab3["checks"][1]            # the last defined in lab3_reduce_scatter
