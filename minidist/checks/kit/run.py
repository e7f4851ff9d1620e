"""Running a check (:class:`minidist.checks.kit.check.Check`): :func:`run`, the same for every check.

Around every answer, the guard: the lab's refusal of minidist's own implementation (on every thread
the graded code runs on), the watch on what graded calls rebind, asynchronous results only at
``wait()`` and NCCL's point-to-point rules (on ranks, :func:`minidist.checks.kit.launch.launch_named`),
the lab's stand-ins for the functions a graded one calls (rebound inside the ranks only). Then each
answer's round trip through plain data, its filing in the docket (:mod:`minidist.checks.kit.docket`)
at an index computed here and nowhere else (a case's index; for ``"groups"``, case × world + rank),
and the verdict on the round-tripped copy, the value the grader's judge reads
(:meth:`~minidist.checks.kit.check.Check.judge`). A passing check prints its ✓ line.
"""
from __future__ import annotations

import contextlib
import re
import tempfile
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from minidist.checks.kit import docket
from minidist.checks.kit.device_check import MADE_NONE, Record, consequence, default_device
from minidist.checks.kit.groups import consecutive_groups, describe_case
from minidist.checks.kit.launch import launch_named, mark_case, one_thread, report_passed
from minidist.checks.kit.refusal import StudentAssertion, graded_call
from minidist.checks.kit.student_code import is_student_code
from minidist.checks.kit.stand_ins import stand_in_lab_functions
from minidist.checks.kit.returned import require_plain
from minidist.checks.kit.withheld import HiddenTestsInGrader, in_confirmation, left_to_confirmation
from minidist.runtime import plain_data
from minidist.runtime.device import device as rank_device
from minidist.runtime.rank_process import format_frame

class StudentRaised(AssertionError):
    """The student's code raised ``raised`` (its type's name) while a check made here called it."""

    def __init__(self, message: str, raised: str):
        super().__init__(message)
        self.raised = raised


class OnRank(NamedTuple):
    """Where a ``"groups"`` answer runs: this rank's place ``r`` in its group of ``t`` ranks, and the group."""
    r: int
    t: int
    group: Any


class RankCase(NamedTuple):
    """What a ``"groups"`` verdict judges: ``case`` as answered by world rank ``rank``, rank ``r`` of its group
    of ``t``, in a test of the graded ``function`` (the Check's)."""
    case: Any
    rank: int
    r: int
    t: int
    function: str = ""


def run(check, fn, **params) -> None:
    """Grade ``fn`` (the graded object, or a tuple of them) with ``check`` on the cases ``params``
    give; raise AssertionError with the first problem; print the ✓ line when all pass. The kit's frames
    are hidden from the notebook's traceback (``__tracebackhide__``): a failure shows the test cell's
    line, then the problem, which names the case and the student's line."""
    __tracebackhide__ = True            # noqa: F841  (IPython: the student's line first, not the kit's)
    if set(params) != set(check.params):
        raise TypeError(f"check {check.name!r} takes the params {check.params}, got {tuple(params)}")
    if params.get("hidden") and in_confirmation(check.lab):      # a grading kernel: the grader's alone
        left_to_confirmation(check.shown)
        return
    try:
        cases = check.cases(**params)
    except HiddenTestsInGrader as err:        # the student package: one line, no frame of the kit's
        raise HiddenTestsInGrader(str(err)) from None
    refusal, stand_ins = check.refusal, check.stand_ins or {}
    if check.prepare is not None:
        check.prepare()
    if check.default_device is None:
        _answer_all(check, fn, params, cases, refusal, stand_ins, None)
    else:
        _device_check(check, fn, params, cases, refusal, stand_ins)
    if check.covered is not None:
        report_passed(check.shown, check.covered(**params), bool(params.get("hidden")))


def _device_check(check, fn, params: dict, cases: list, refusal, stand_ins: dict) -> None:
    """The device check (:mod:`minidist.checks.kit.device_check`): the answers made under its default
    device. When an answer failed and a line of the student's made a tensor without a device, it fails,
    leading with that line; an answer that failed with no such line (a wrong value, an error of the
    student's own, a hang) is its function's own test's to judge, and the record :data:`MADE_NONE` is
    filed in its place. A function not written yet (the release's stub raises NotImplementedError) has
    shown nothing about its tensors: it fails, saying so."""
    __tracebackhide__ = True            # noqa: F841  (IPython: the student's line first, not the kit's)
    with tempfile.TemporaryDirectory(prefix="minidist-device-") as folder:
        record = Record(check.default_device, folder, check.device_advice)
        try:
            _answer_all(check, fn, params, cases, refusal, stand_ins, record)
            return
        except Exception as err:     # noqa: BLE001  an answer that failed, whatever it raised
            failure = err
        explained = record.explain(check.shown, failure)
    if explained is not None:
        raise AssertionError(explained) from None
    if _not_written(failure):
        raise AssertionError(f"{check.shown}: not written yet ({consequence(failure)}); the device check "
                             f"runs it once it is") from None
    for i, item in enumerate(check.judged_cases(params)):
        made = [MADE_NONE] * check.world(item) if check.where == "launch" else MADE_NONE
        problem = docket.file(check.key, params, i, plain_data.dumps(made), check.shown)
        if problem:
            raise AssertionError(problem)


def _not_written(failure: BaseException) -> bool:
    """Whether the student's code raised NotImplementedError (a stub of the release), here or on a rank."""
    raised = [getattr(failure, "raised", None), type(failure).__name__] + [m for text in (getattr(failure, "failures", None) or {}).values()
                                                   for m in re.findall(r"raised: (\w+)", text)]
    return "NotImplementedError" in raised


def _answer_all(check, fn, params: dict, cases: list, refusal, stand_ins: dict, record) -> None:
    """Every answer of ``check`` on ``cases``, each filed and judged; ``record``: the device check's."""
    __tracebackhide__ = True            # noqa: F841  (IPython: the student's line first, not the kit's)
    if check.where == "here":
        for i, case in enumerate(cases):
            _require(check, params, i, case, _here(record, refusal, check, fn, case))
    elif check.where == "launch":
        for i, case in enumerate(cases):
            options = dict(check.launch(case) if callable(check.launch) else check.launch or {})
            if "reference" in options:      # reference(case), on the rank before the answer, outside the refusal
                options["reference"] = partial(_reference, options["reference"])
            results = launch_named(_launch_answer, check.world(case), check.answer, fn, case, stand_ins,
                                   name=check.shown, timeout=check.timeout * options.pop("timeout_factor", 1),
                                   refuse=refusal, device=record and record.launched, **options)
            _require(check, params, i, case, results)
    else:
        options = dict(check.launch or {})
        out = launch_named(_group_answers, check.world, check, fn, cases, stand_ins, name=check.shown,
                           timeout=check.timeout * options.pop("timeout_factor", 1), refuse=refusal,
                           device=record and record.launched, **options)
        failed, sizes = None, {}
        for i, item in enumerate(check.judged_cases(params)):
            problem, data = out[item.rank][i // check.world]
            if data is not None:
                problem = problem or docket.file(check.key, params, i, data, check.shown)
            if not (problem or "").startswith("not run"):        # a case never run tells nothing
                sizes.setdefault(item.t, []).append(problem is None)
            failed = failed or (check.stated(item, problem) if problem else None)
        if failed:
            raise AssertionError(failed + by_group_size(sizes))


def _here(record, refusal, check, fn, case):
    """A ``"here"`` answer, under the device check's default device when there is one (restored after);
    with the ``reference`` option, ``answer(fn, case, reference=reference(case))``, the reference made
    before, outside the refusal (what the case starts from, built with the library the refusal refuses).
    An exception of the student's code becomes an AssertionError naming the case and the student's lines."""
    __tracebackhide__ = True            # noqa: F841  (IPython: the student's line first, not the kit's)
    options = check.launch(case) if callable(check.launch) else check.launch or {}
    before = {"reference": options["reference"](case)} if "reference" in options else {}
    try:
        with default_device(record.device, record.here) if record is not None else contextlib.nullcontext():
            return graded_call(refusal, check.shown, check.answer, fn, case, **before)
    except (AssertionError, NotImplementedError):   # a failed check; a function not written yet says so itself
        raise
    except Exception as err:     # noqa: BLE001  the student's code raised: say in which case, and where
        raise StudentRaised(student_raised(check.shown, case, err), type(err).__name__) from None


def student_raised(shown: str, case, err: BaseException) -> str:
    """"fn (case): your code raised IndexError: ...", then the student's frames of ``err`` (innermost
    last; none of the kit's, torch's or minidist's): what an exception of graded code tells a student."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_student_code(code.co_filename):
            frames.append(format_frame(code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    said = str(err) if isinstance(err, StudentAssertion) else f"your code raised {type(err).__name__}: {err}"
    where = "".join("\n  " + f.replace("\n", "\n  ") for f in frames[-3:])
    return f"{shown} ({shown_case(case)}): {said}{where}"


def shown_case(case) -> str:
    """A case in a few words: its settings, a tensor by its shape and dtype, a long value cut short."""
    def one(v) -> str:
        if isinstance(v, torch.Tensor):
            return f"a {str(v.dtype).replace('torch.', '')} tensor of shape {tuple(v.shape)}"
        if isinstance(v, (list, tuple)) and v and any(isinstance(x, torch.Tensor) for x in v):
            return f"{len(v)} tensors"
        text = getattr(v, "__name__", None) or repr(v).replace("torch.", "")
        return text if len(text) <= 80 else text[:77] + "..."
    if isinstance(case, dict):
        return ", ".join(f"{k}={one(v)}" for k, v in case.items()) or "default sizes"
    return one(case)


def _require(check, params: dict, index: int, case, answer) -> None:
    """File the answer to case ``index`` and raise AssertionError with its verdict's problem, given on
    the answer after its round trip through plain data (the value the judge reads). An object of the
    student's own (a float subclass) is refused before it is read: reading it would run its code."""
    __tracebackhide__ = True            # noqa: F841  (IPython: the student's line first, not the kit's)
    require_plain(check.shown, answer)
    try:
        data = plain_data.dumps(answer)
    except TypeError as err:
        raise AssertionError(f"{check.shown} returned something that is not plain data ({err})") from None
    problem = check.problem(case, plain_data.loads(data))
    if problem:
        raise AssertionError(problem)    # a wrong answer reads as an assertion, as the grader classes it
    problem = docket.file(check.key, params, index, data, check.shown)
    if problem:
        raise AssertionError(problem)


def _reference(reference, progress, answer, fn, case, stand_ins):
    return reference(case)


def _launch_answer(progress, answer, fn, case, stand_ins, **reference):
    """Inside a rank of a ``"launch"`` check: this rank's answer to ``case``, as plain data (with the
    ``reference`` launch option: ``answer(fn, case, reference=...)``, what ``reference(case)`` measured
    on this rank before the student's code ran)."""
    stand_in_lab_functions(fn, stand_ins)
    with _marking(progress):
        out = answer(fn, case, **reference)
    require_plain("the graded code", out)        # here, where the refusal still holds: no object of the student's
    return out


def _group_answers(progress, check, fn, cases: list, stand_ins: dict) -> list:
    """Inside a rank of a ``"groups"`` check: (problem, answer as plain data) for every case, each run
    on its group of ``case["t"]`` ranks and judged here at once (the notebook shows a failure as it
    happens); with ``stop_at_first_failure``, every rank stops after the first case that failed on any."""
    stand_in_lab_functions(fn, stand_ins)
    groups = consecutive_groups((c["t"] for c in cases), check.world)
    rank, out = dist.get_rank(), []
    with one_thread(), _marking(progress):
        for case in cases:
            group, r, t = groups[case["t"]]
            mark(f"t={case['t']}: {describe_case(case)}")
            answer = check.answer(fn, case, OnRank(r, t, group))
            try:
                require_plain("the graded code", answer)
                data = plain_data.dumps(answer)
            except AssertionError as err:
                out.append((str(err), None))
            except TypeError as err:
                out.append((f"returned something that is not plain data ({err})", None))
            else:
                out.append((check.found(RankCase(case, rank, r, t, check.function), plain_data.loads(data)), data))
            if check.stop_at_first_failure and not every_rank_passed(out[-1][0] is None):
                break
    return out + [("not run: an earlier case failed", None)] * (len(cases) - len(out))


def by_group_size(sizes: dict) -> str:
    """"\n(groups of t = 4 pass; of t = 2, some fail)" when the group's size is what tells the passing
    cases from the failing ones (``sizes``: {t: [passed, ...] over its cases and ranks}), else ""."""
    passing = sorted(t for t, ok in sizes.items() if all(ok))
    failing = sorted(t for t, ok in sizes.items() if not all(ok))
    if not passing or not failing:
        return ""
    show = lambda ts: ", ".join(f"t = {t}" for t in ts)     # noqa: E731
    return (f"\n(every case with {show(passing)} passes; cases with {show(failing)} fail: what differs "
            f"between those group sizes?)")


def every_rank_passed(passed: bool, group=None) -> bool:
    """Inside a rank: whether every rank of ``group`` passed (one all-reduce of a flag, outside any
    trace). Ranks that go on to the next half of a case (a backward pass, the next step) only
    together never leave a peer alone in a collective: one rank's failure stops its whole group."""
    failed = torch.tensor([int(not passed)], device=rank_device())
    dist.all_reduce(failed, group=group)
    return not failed.item()


# ----------------------------------------------------------------------------- marking the running case
_progress: list = []


@contextlib.contextmanager
def _marking(progress: str):
    _progress.append(progress)
    try:
        yield
    finally:
        _progress.pop()


def mark(text: str) -> None:
    """Inside a rank: the case this rank starts now (a launch that fails names it). An answer that runs
    several sub-cases in one launch marks each."""
    if _progress:
        mark_case(_progress[-1], text)
