"""A check's verdict, given again by a process that never ran student code (issue 27, item 2).

A pure check calls the student's function on cases of its own, then compares each answer with a
reference. In the grader's confirmation both happen in the child that ran the solution cells, so
code a solution cell left behind (a thread, a patched module) runs next to the comparison. A
*judged* check splits the two: its verdict is a pure function of one case and of the answer
as plain data (:mod:`minidist.runtime.plain_data`), and every answer is filed in the *docket*.
The grader's judge (``autograder/confirm/judge.py``, a process that never runs student code)
reads the docket, takes the cases from the check itself, computes the references itself and
gives each verdict again; a test the child reports passed keeps its points only if the judge
agrees, and a case with no answer filed is a failure. So a verdict can no longer be forged in
the child: only answers can be filed there, and only right answers pass.

A judged check is declared once and used by the check and by the judge alike::

    STAGES = Judged(__name__, "stage_parameters", cases=_stage_cases, verdict=_stage_verdict)

    @judged(STAGES)
    def check_stage_parameters(fn, hidden=False):
        for i, case in enumerate(STAGES.cases(hidden=hidden)):
            STAGES.require(dict(hidden=hidden), i, case, graded_call(..., fn, *case))

The notebook's run and the judge take the verdict from the same function of the same value: the
answer after a round trip through plain data (what the judge reads). Answers are filed only where
``MINIDIST_DOCKET=1`` (the confirmation's runner sets it), read once at import.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import torch

from minidist.protocol import DOCKET_ENV, DOCKET_MAX_BYTES
from minidist.runtime import plain_data

#: Whether answers are filed (the grader's confirmation). Read once, before any student code.
ON = os.environ.get(DOCKET_ENV) == "1"
_entries: list = []          # (key, params key, case index, plain data bytes) filed since the runner emptied it
_size = [0, 0]               # [entries, bytes] of the docket when last counted (a running total)
MAX_BYTES = DOCKET_MAX_BYTES   # a test's answers past this are not filed: the test fails in the confirmation


class Judged:
    """One pure check: ``cases(**params)`` lists its cases, ``verdict(case, answer)`` says what is
    wrong with an answer (None when it is right). ``params`` are the check's arguments that decide
    its cases (``hidden``; ``kind`` for a schedule); a test cell gives them as constants."""

    def __init__(self, module: str, name: str, cases: Callable[..., list],
                 verdict: Callable[[object, object], str | None], params: tuple[str, ...] = ("hidden",)):
        self.key, self.name, self.params = f"{module}.{name}", name, params
        self.cases, self.verdict = cases, verdict

    @classmethod
    def of_functions(cls, module: str, name: str, table: dict) -> "Judged":
        """One judged check for several graded functions, called as ``check(name, fn, hidden)``:
        ``table`` maps a graded name to ``(cases(hidden), verdict(case, answer))``. Its cases are
        ``(graded name, case)``; a name missing from the table has none (nothing is judged)."""
        def cases(name, hidden):
            return [(name, case) for case in table[name][0](hidden)] if name in table else []
        return _PerFunction(module, name, cases, lambda case, answer: table[case[0]][1](case[1], answer),
                            params=("name", "hidden"))

    def run(self, params: dict, answer_of: Callable[[object], object]) -> None:
        """Every case's answer, ``answer_of(case)``, filed and required in turn."""
        for i, case in enumerate(self.cases(**params)):
            self.require(params, i, case, answer_of(self.graded_case(case)))

    def graded_case(self, case):
        """What the graded function is given for ``case``: the case itself."""
        return case

    def require(self, params: dict, index: int, case, answer) -> None:
        """File the answer to case ``index`` and raise AssertionError with its verdict's problem."""
        try:
            data = plain_data.dumps(answer)
        except TypeError as err:
            raise AssertionError(f"{self.name} returned something that is not plain data ({err})") from None
        problem = self.verdict(case, plain_data.loads(data)) or self.file(params, index, data)
        if problem:
            raise AssertionError(problem)

    def file(self, params: dict, index: int, data: bytes) -> str | None:
        return file(self.key, params, index, data, self.name)

    def judge(self, params: dict, entries) -> str | None:
        """The verdict of a whole call of the check (``params`` as the test cell gave them) from the
        docket's entries: the first problem, or that a case has no answer; None when all pass."""
        cases, want = self.cases(**params), _params_key(params)
        answered = set()
        for entry in entries:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 4 and entry[0] == self.key and entry[1] == want):
                continue
            index, data = entry[2], entry[3]
            if not (type(index) is int and 0 <= index < len(cases) and isinstance(data, bytes)):
                return f"{self.name}: the docket holds a malformed answer ({index!r})"
            try:
                answer = plain_data.loads(data)
            except ValueError as err:
                return f"{self.name}: an answer in the docket is not plain data ({err})"
            problem = self.verdict(cases[index], answer)
            if problem:
                return problem
            answered.add(index)
        missing = sorted(set(range(len(cases))) - answered)
        if missing:
            return (f"{self.name}: no answer was filed for {len(missing)} of its {len(cases)} cases "
                    f"(the first: {cases[missing[0]]!r})")
        return None


class _PerFunction(Judged):
    """A check of several graded functions (:meth:`Judged.of_functions`): its cases are
    ``(graded name, case)``, and the graded function is given the case without its name."""

    def graded_case(self, case):
        return case[1]


def params_key(params: dict) -> str:
    """A check's params as the docket keys them (the test cell gives them as constants)."""
    return json.dumps({k: params[k] for k in sorted(params)})


_params_key = params_key


def file(key: str, params: dict, index: int, data: bytes, name: str) -> str | None:
    """File the answer (plain data) to case ``index`` of the check ``key`` where answers are filed
    (``ON``); the problem when the docket is full (the judge would find no answer to this case)."""
    if not ON:
        return None
    if len(_entries) != _size[0]:         # the runner emptied the docket since: count afresh
        _size[:] = [len(_entries), sum(len(e[3]) for e in _entries)]
    if _size[1] + len(data) > MAX_BYTES:
        return (f"{name}: its answers come to more than the {MAX_BYTES >> 20} MiB the grader keeps for "
                f"one test, so this test cannot be confirmed (are the results far larger than the cases ask?)")
    _entries.append((key, params_key(params), int(index), data))
    _size[:] = [len(_entries), _size[1] + len(data)]
    return None


def entries() -> list:
    """The list answers are filed in (the confirmation's runner holds it from before any student code)."""
    return _entries


def judged(*judged_checks: Judged):
    """Mark a check function as judged by ``judged_checks`` (the grader's judge finds them there and
    asks each for its verdict: a check whose cases run partly here, partly on ranks has two)."""
    def mark(check):
        check.judged = judged_checks
        return check
    return mark


def from_raising(compare: Callable[[object, object], None]) -> Callable[[object, object], str | None]:
    """A verdict from a comparison that raises AssertionError with its problem (a check that
    launches: ``compare(run, results)`` on every rank's results as plain data). An answer the
    comparison cannot read (a KeyError on a forged one) is a problem too, never a crash."""
    def verdict(case, answer) -> str | None:
        try:
            compare(case, answer)
        except AssertionError as err:
            return str(err)
        except Exception as err:      # noqa: BLE001  (a malformed answer: it fails, it does not stop the judge)
            return f"the results could not be judged ({type(err).__name__}: {str(err)[:200]})"
        return None
    return verdict


def digest(x: torch.Tensor) -> str:
    """An answer's record of a tensor that must come back unchanged (an input): its dtype, shape and
    bytes, hashed. The verdict compares it with the digest of the input it rebuilds."""
    flat = x.detach().to("cpu").contiguous()
    body = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.sha256(f"{flat.dtype} {tuple(flat.shape)} ".encode() + body).hexdigest()


def outcome(call: Callable[[], object]) -> dict:
    """What a call that should raise ValueError did, as plain data: ``{"raised": "ValueError"}``,
    ``{"raised": name, "message": text}`` for another exception, ``{"returned": True}`` if it
    returned (the value itself does not matter)."""
    try:
        call()
    except ValueError:
        return {"raised": "ValueError"}
    except Exception as err:      # noqa: BLE001  (a TypeError from range(1.5) is not the contract's error)
        return {"raised": type(err).__name__, "message": str(err)[:300]}
    return {"returned": True}
