"""One way to write a check: a :class:`Check` says what is graded, :func:`~minidist.checks.kit.run.run` runs it.

A check grades a student's function on cases, in three plain functions that live in the lab's
folder (``docs/AUTHORING.md``):

* ``cases(**params)`` (``cases.py``): the cases for the arguments a test cell gives (``hidden``...);
* ``answer(fn, case)`` (``answers.py``, the only file that calls student code): what the student's
  code did on one case, as plain data (:mod:`minidist.runtime.plain_data`);
* ``verdict(case, answer)`` (``verdicts.py``): what is wrong with that answer (None: nothing). It
  rebuilds what it compares with from the case alone, so any process can give it again.

Where the answer is made (``where``):

* ``"here"``: in this process;
* ``"launch"``: on the ranks of one launch per case (``world(case)`` ranks); ``answer`` runs on every
  rank, and the verdict reads every rank's answer, a list by rank;
* ``"groups"``: every case in one launch of ``world`` ranks cut into groups of ``case["t"]``
  consecutive ranks (:mod:`minidist.checks.kit.groups`); ``answer(fn, case, on)`` runs on every
  rank (``on``: its rank in the group, the group's size, the group), and the verdict judges one
  rank: ``verdict(RankCase(case, rank, r, t), answer)``.

:func:`run` is the same for every check: the guard around every answer (the lab's refusal of
minidist's own implementation on every thread, the watch on what graded calls rebind, asynchronous
results only at ``wait()``, NCCL's point-to-point rules, stand-ins for the lab's other functions),
each answer's round trip through plain data, its filing in the docket (:mod:`...docket`) at an
index computed in one place, and the verdict on the round-tripped copy: exactly what the grader's
judge gives again from the docket (:meth:`Check.judge`). The ✓ line comes from ``covered``.

A lab declares its checks and the public functions its test cells call in one :class:`Registry`
(``CHECKS``): the grader's judge resolves a test cell's call through it, and a call it cannot
resolve earns nothing.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from minidist.checks.kit import docket
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.kit.run import RankCase, first, run
from minidist.runtime import plain_data

WHERE = ("here", "launch", "groups")


@dataclasses.dataclass(frozen=True)
class Check:
    """One graded check, declared once (:meth:`Registry.check`) and run by :func:`run` and the judge alike.

    ``params``: the test cell's arguments that decide the cases (given as constants there);
    ``refusal``: what is refused while answers run (a :class:`Refusal`, or a function of the params);
    ``stand_ins``: {name: function} for the lab's other functions a graded one calls, rebound inside
    the ranks (a function of the params); ``covered(**params)``: the ✓ line's text; ``title``: what
    failures and the ✓ line call it (default: ``name``, which must be unique in the lab); ``world``:
    ranks per launch (a number for ``"groups"``, a function of the case for ``"launch"``);
    ``launch``: more keywords for :func:`~minidist.checks.kit.launch.launch_named` (a dict, or a
    function of the case for ``"launch"`` and ``"here"``): ``outputs_at_wait``, ``forbidden_hint``,
    ``timeout_factor`` (scales the call's timeout) and, for ``"launch"`` and ``"here"`` (its only
    one there), ``reference(case)`` (run before the answer, outside the refusal: on each rank, or in
    this process; its result reaches the answer as ``reference=``);
    ``stop_at_first_failure``: a ``"groups"`` check stops at the first case that failed anywhere;
    ``prepare()``: run in the calling process before the ranks are launched (what forked ranks should
    inherit rather than each load, lab 5's ``torch._dynamo``); ``default_device``: torch's default
    device where the answer is made (``"meta"``: the device check, :mod:`minidist.checks.kit.device_check`,
    made with its ``on_meta``)."""
    lab: str
    name: str
    cases: Callable[..., list]
    answer: Callable
    verdict: Callable[[Any, Any], Any]
    where: str = "here"
    params: tuple[str, ...] = ("hidden",)
    refusal: Refusal | Callable[[dict], Refusal | None] | None = None
    stand_ins: Callable[[dict], dict] | None = None
    covered: Callable[..., str] | None = None
    title: str | None = None
    world: int | Callable[[Any], int] | None = None
    launch: dict | Callable[[Any], dict] | None = None
    stop_at_first_failure: bool = False
    prepare: Callable[[], None] | None = None
    default_device: str | None = None

    def __post_init__(self):
        if self.where not in WHERE:
            raise ValueError(f"check {self.name!r}: where must be one of {WHERE}, not {self.where!r}")
        if self.where != "here" and self.world is None:
            raise ValueError(f"check {self.name!r} runs on ranks: say how many (world=...)")

    @property
    def shown(self) -> str:
        return self.title or self.name

    @property
    def key(self) -> str:
        """What names this check's answers in the docket."""
        return f"{self.lab}.{self.name}"

    def judged_cases(self, params: dict) -> list:
        """What one verdict judges, in docket order: the cases, or for ``"groups"`` every (case, rank)."""
        cases = self.cases(**params)
        if self.where != "groups":
            return cases
        out = []
        for case in cases:
            for rank in range(self.world):
                start = rank - rank % case["t"]
                out.append(RankCase(case, rank, rank - start, min(case["t"], self.world - start)))
        return out

    def found(self, item, answer) -> str | None:
        """The verdict on one judged case: its first problem, or None. An answer the verdict cannot read (a
        forged one) is a problem too, never a crash of the check or of the judge."""
        try:
            return first(self.verdict(item, answer))
        except Exception as err:     # noqa: BLE001
            return f"the answer could not be judged ({type(err).__name__}: {str(err)[:200]})"

    def problem(self, item, answer) -> str | None:
        """The verdict on one judged case, as a failure states it (a rank's case names the case and rank)."""
        return self.stated(item, self.found(item, answer))

    def stated(self, item, problem: str | None) -> str | None:
        """``problem`` as a failure states it: for a rank's case, after the case and the rank."""
        if problem and self.where == "groups":
            case, rank, r, t = item
            return f"{self.shown} (t={t}, {describe_case(case)}), rank {rank} (rank {r} of its group): {problem}"
        return problem

    def judge(self, params: dict, entries) -> str | None:
        """The verdict of a whole call (``params`` as the test cell gave them) from the docket's
        entries, given by a process that ran no student code: the first problem, or that a case has
        no answer; None when every case has a right answer."""
        items, want = self.judged_cases(params), docket.params_key(params)
        answered = set()
        for entry in entries:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 4 and entry[0] == self.key and entry[1] == want):
                continue
            index, data = entry[2], entry[3]
            if not (type(index) is int and 0 <= index < len(items) and isinstance(data, bytes)):
                return f"{self.shown}: the docket holds a malformed answer ({index!r})"
            try:
                answer = plain_data.loads(data)
            except ValueError as err:
                return f"{self.shown}: an answer in the docket is not plain data ({err})"
            problem = self.problem(items[index], answer)
            if problem:
                return problem
            answered.add(index)
        missing = sorted(set(range(len(items))) - answered)
        if missing:
            return (f"{self.shown}: no answer was filed for {len(missing)} of its {len(items)} cases "
                    f"(the first: {items[missing[0]]!r})")
        return None


class Registry:
    """A lab's checks (``CHECKS`` in its ``__init__.py``): the :class:`Check`\\ s, and each public check
    function a test cell calls with the checks that call runs. The function runs and the judge
    resolves through the same :meth:`resolve`, so what a call runs is what the judge judges."""

    def __init__(self, lab: str):
        self.lab = lab
        self.entries: dict[str, tuple[Callable, Any, str | None]] = {}

    def check(self, name: str, cases, answer, verdict, **options) -> Check:
        """A :class:`Check` of this lab (options: see :class:`Check`)."""
        return Check(self.lab, name, cases, answer, verdict, **options)

    def entry(self, checks, by: str | None = None):
        """Decorator of a public check function, written as its signature and docstring alone:
        calling it runs ``checks`` (a Check or a tuple of them; with ``by``, a dict {value of the
        argument ``by``: Check or tuple}). Its other arguments are the Check's params, ``timeout``,
        and the graded objects, handed to the answers in order (one alone, several as a tuple)."""
        def register(stub: Callable) -> Callable:
            self.entries[stub.__name__] = (stub, checks, by)

            @passes_quietly
            def call(*args, **kwargs):
                for check, params, graded, timeout in self.resolve(stub.__name__, args, kwargs):
                    run(check, graded, timeout=timeout, **params)
            call.__name__, call.__qualname__, call.__doc__ = stub.__name__, stub.__qualname__, stub.__doc__
            call.__signature__ = inspect.signature(stub)
            call.__wrapped_stub__ = stub
            return call
        return register

    def resolve(self, name: str, args: tuple, kwargs: dict) -> list[tuple[Check, dict, Any, float | None]]:
        """(check, its params, the graded objects, timeout) for every Check a call ``name(*args,
        **kwargs)`` runs. Raises TypeError for a call that does not fit the function, ValueError for a
        ``by`` value that names no check."""
        stub, checks, by = self.entries[name]
        bound = inspect.signature(stub).bind(*args, **kwargs)
        bound.apply_defaults()
        chosen = checks
        if by is not None:
            if bound.arguments[by] not in checks:
                raise ValueError(f"{self.lab.rsplit('.', 1)[-1]} has no graded function {bound.arguments[by]!r}; "
                                 f"graded: {', '.join(map(str, checks))}")
            chosen = checks[bound.arguments[by]]
        chosen = chosen if isinstance(chosen, tuple) else (chosen,)
        taken = {by, "timeout"} | {p for c in chosen for p in c.params}
        graded = [v for k, v in bound.arguments.items() if k not in taken]
        return [(c, {p: bound.arguments[p] for p in c.params}, graded[0] if len(graded) == 1 else tuple(graded),
                 bound.arguments.get("timeout")) for c in chosen]
