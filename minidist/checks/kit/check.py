"""One way to write a check: a :class:`Check` says what is graded, :func:`~minidist.checks.kit.run.run` runs it.

A check grades a student's function on cases, in three plain functions (``docs/AUTHORING.md``):

* ``cases(**params)``: the cases for the arguments a test cell gives (``hidden``...);
* ``answer(fn, case)`` (the lab's ``answers.py``, the only code that calls student code; the kit's
  :func:`called` for the common case): what the student's code did on one case, as plain data
  (:mod:`minidist.runtime.plain_data`);
* ``verdict(case, answer) -> str | None``: what is wrong with that answer (None: nothing). It rebuilds
  what it compares with from the case alone, so any process can give it again. One signature for
  every check: what a verdict needs to know (the graded function's name) is in what it judges.

Where the answer is made (``where``):

* ``"here"``: in this process;
* ``"launch"``: on the ranks of one launch per case (``world(case)`` ranks); ``answer`` runs on every
  rank, and the verdict reads every rank's answer, a list by rank (the Check counts the ranks first);
* ``"groups"``: every case in one launch of ``world`` ranks cut into groups of ``case["t"]``
  consecutive ranks (:mod:`minidist.checks.kit.groups`); ``answer(fn, case, on)`` runs on every
  rank (``on``: its rank in the group, the group's size, the group), and the verdict judges one
  rank: ``verdict(RankCase(case, rank, r, t, function), answer)``.

:func:`run` is the same for every check: the guard around every answer (the lab's refusal of
minidist's own implementation on every thread, the watch on what graded calls rebind, asynchronous
results only at ``wait()``, NCCL's point-to-point rules, stand-ins for the lab's other functions),
each answer's round trip through plain data, its filing in the docket (:mod:`...docket`) at an
index computed in one place, and the verdict on the round-tripped copy: exactly what the grader's
judge gives again from the docket (:meth:`Check.judge`). The ✓ line comes from ``covered``.

A lab declares its checks and the public functions its test cells call in one :class:`Registry`
(``CHECKS``): the grader's judge resolves a test cell's call through it, and a call it cannot
resolve earns nothing. Names: a Check is named after the test cell that runs it (its ``grade_id``
without ``test_``; a second Check of the same cell adds a word: ``"zero2 memory"``; a device check
adds ``" device"`` to its base Check's name), the public function after the graded one
(``check_<function>``, in snake case; ``check_<function>_<aspect>`` for a further test of it), and
``check_device(fn)`` finds a function's device checks by its name.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any, Callable

from minidist.checks.kit import docket
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.failure import renders_itself
from minidist.checks.kit.groups import describe_case
from minidist.checks.kit.launch import TIMEOUT
from minidist.checks.kit.quiet import passes_quietly
from minidist.checks.kit.refusal import Refusal
from minidist.checks.kit.run import RankCase, run
from minidist.runtime import plain_data

WHERE = ("here", "launch", "groups")
#: ``Registry.entry(..., by=BY_NAME)``: the checks are chosen by the graded object's ``__name__`` (the judge
#: reads the name the test cell passes)
BY_NAME = "__name__"


def called(fn, case):
    """The common case's answer: ``fn(*case["args"])``, what the student's function returned."""
    return fn(*case["args"])


def snake(name: str) -> str:
    """``BucketedDDP`` -> ``bucketed_ddp``: how a public check function names a graded class."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


@dataclasses.dataclass(frozen=True)
class Check:
    """One graded check, declared once (:meth:`Registry.check`) and run by :func:`run` and the judge alike.

    ``name``: after the test cell that runs it (unique in the lab; the docket's key); ``function``: the
    graded function's (or class's) name in the notebook (default: ``name``), which failures and the ✓
    line show unless ``title`` says otherwise; ``params``: the test cell's arguments that decide the
    cases (given as constants there); ``refusal``: what is refused while answers run (default: the
    lab's); ``stand_ins``: {name: function} for the lab's other functions a graded one calls, rebound
    inside the ranks (:mod:`minidist.checks.kit.stand_ins`); ``covered(**params)``: the ✓ line's text;
    ``world``: ranks per launch (a number for ``"groups"``, a function of the case for ``"launch"``);
    ``timeout``: seconds per launch (default :data:`~minidist.checks.kit.launch.TIMEOUT`); ``launch``:
    more keywords for :func:`~minidist.checks.kit.launch.launch_named` (a dict, or a function of the
    case for ``"launch"`` and ``"here"``): ``outputs_at_wait``, ``forbidden_hint``, ``timeout_factor``
    (scales the timeout) and, for ``"launch"`` and ``"here"`` (its only one there), ``reference(case)``
    (run before the answer, outside the refusal: on each rank, or in this process; its result reaches
    the answer as ``reference=``); ``stop_at_first_failure``: a ``"groups"`` check stops at the first
    case that failed anywhere; ``prepare()``: run in the calling process before the ranks are launched
    (what forked ranks should inherit rather than each load, lab 5's ``torch._dynamo``);
    ``default_device``: torch's default device where the answer is made (``"meta"``: the device check,
    :mod:`minidist.checks.kit.device_check`, made with its ``on_meta``); ``device_advice``: the device
    check's last line, what such a tensor would do on a GPU node (default: device_check's ``GPU_NODE``)."""
    lab: str
    name: str
    cases: Callable[..., list]
    answer: Callable
    verdict: Callable[[Any, Any], str | None]
    where: str = "here"
    params: tuple[str, ...] = ("hidden",)
    refusal: Refusal | None = None
    stand_ins: dict | None = None
    covered: Callable[..., str] | None = None
    function: str | None = None
    title: str | None = None
    world: int | Callable[[Any], int] | None = None
    timeout: float = TIMEOUT
    launch: dict | Callable[[Any], dict] | None = None
    stop_at_first_failure: bool = False
    prepare: Callable[[], None] | None = None
    default_device: str | None = None
    device_advice: str | None = None

    def __post_init__(self):
        if self.where not in WHERE:
            raise ValueError(f"check {self.name!r}: where must be one of {WHERE}, not {self.where!r}")
        if self.where != "here" and self.world is None:
            raise ValueError(f"check {self.name!r} runs on ranks: say how many (world=...)")
        if self.function is None:
            object.__setattr__(self, "function", self.name)

    @property
    def shown(self) -> str:
        return self.title or self.function

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
                out.append(RankCase(case, rank, rank - start, min(case["t"], self.world - start), self.function))
        return out

    def found(self, item, answer) -> str | None:
        """The verdict on one judged case: its problem, or None. An answer the verdict cannot read (a forged
        one, a launch's with another number of ranks) is a problem too, never a crash of the check or of
        the judge; a verdict that returns anything but ``str | None`` is the lab's mistake, and raises."""
        if self.where == "launch":
            world = self.world(item)
            if not isinstance(answer, list):
                return f"{self.shown}: the answer is no list by rank ({type(answer).__name__})"
            if len(answer) != world:
                return f"{self.shown}: {len(answer)} ranks answered, the launch had {world}"
        try:
            problem = self.verdict(item, answer)
        except Exception as err:     # noqa: BLE001
            return f"{self.shown}: the answer could not be judged ({type(err).__name__}: {str(err)[:200]})"
        if problem is not None and not isinstance(problem, str):
            raise TypeError(f"check {self.key}: its verdict returned a {type(problem).__name__}; a verdict "
                            f"returns a str (the problem) or None")
        return problem or None

    def problem(self, item, answer) -> str | None:
        """The verdict on one judged case, as a failure states it (a rank's case names the case and rank)."""
        return self.stated(item, self.found(item, answer))

    def stated(self, item, problem: str | None) -> str | None:
        """``problem`` as a failure states it: for a rank's case, after the case and the rank."""
        if problem and self.where == "groups":
            case, rank, r, t = item.case, item.rank, item.r, item.t
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
    """A lab's checks (``CHECKS`` in its ``__init__.py``): the :class:`Check`\\ s (``checks``, by name), and
    each public check function a test cell calls with the checks that call runs. The function runs and
    the judge resolves through the same :meth:`resolve`, so what a call runs is what the judge judges.
    ``refusal``: the lab's (``REFUSED``), every check's unless it gives its own."""

    def __init__(self, lab: str, refusal: Refusal | None = None):
        self.lab, self.refusal = lab, refusal
        self.checks: dict[str, Check] = {}
        self.entries: dict[str, tuple[Callable, Any, str | None]] = {}

    def _add(self, check: Check) -> Check:
        if check.name in self.checks:
            raise ValueError(f"{self.lab} has a check named {check.name!r} already")
        self.checks[check.name] = check
        return check

    def check(self, name: str, cases, answer, verdict, **options) -> Check:
        """A :class:`Check` of this lab (options: see :class:`Check`)."""
        options.setdefault("refusal", self.refusal)
        return self._add(Check(self.lab, name, cases, answer, verdict, **options))

    def exercise(self, name: str, **options) -> Check:
        """The Check ``name`` of an exercise written as one module of the lab (``<lab>/<name>.py``): its
        ``cases``, ``verdict`` and ``covered``; its answer the kit's :func:`called` unless ``answer=`` gives
        the lab's own (options: see :class:`Check`)."""
        module = importlib.import_module(f"{self.lab}.{name}")
        options.setdefault("covered", getattr(module, "covered", None))
        return self.check(name, module.cases, options.pop("answer", called), module.verdict, **options)

    def devices(self, *checks: Check, advice: str | None = None,
                rule: str | None = None) -> dict[str, tuple[Check, ...]]:
        """The device checks of ``checks`` (:func:`~minidist.checks.kit.device_check.on_meta`), by graded
        function: what ``check_device(fn)`` runs (``entry(..., by=BY_NAME)``); ``advice`` and ``rule``:
        their failure's last line and what their ✓ line confirms, where the default (tensors belong on
        their inputs' device) is not the lab's rule."""
        out: dict[str, tuple[Check, ...]] = {}
        for check in checks:
            rules = {} if rule is None else {"rule": rule}
            out[check.function] = out.get(check.function, ()) + (self._add(on_meta(check, advice=advice, **rules)),)
        return out

    def entry(self, checks, by: str | None = None):
        """Decorator of a public check function, written as its signature and docstring alone:
        calling it runs ``checks`` (a Check or a tuple of them; with ``by``, a dict {value of the
        argument ``by``, or with :data:`BY_NAME` the graded object's name: Check or tuple}). Its other
        arguments are the Check's params and the graded objects, handed to the answers in order (one
        alone, several as a tuple)."""
        def register(stub: Callable) -> Callable:
            self.entries[stub.__name__] = (stub, checks, by)

            @passes_quietly
            def call(*args, **kwargs):
                __tracebackhide__ = True        # noqa: F841  (IPython: the test cell's line, then the problem)
                try:
                    for check, params, graded in self.resolve(stub.__name__, args, kwargs):
                        run(check, graded, **params)
                except Exception as err:
                    raise renders_itself(err)       # the student's frames and the message, no frame of ours
            call.__name__, call.__qualname__, call.__doc__ = stub.__name__, stub.__qualname__, stub.__doc__
            call.__signature__ = inspect.signature(stub)
            call.__wrapped_stub__ = stub
            return call
        return register

    def resolve(self, name: str, args: tuple, kwargs: dict) -> list[tuple[Check, dict, Any]]:
        """(check, its params, the graded objects) for every Check a call ``name(*args, **kwargs)`` runs.
        Raises TypeError for a call that does not fit the function, ValueError for a ``by`` value that
        names no check."""
        stub, checks, by = self.entries[name]
        bound = inspect.signature(stub).bind(*args, **kwargs)
        bound.apply_defaults()
        chosen = checks
        if by is not None:
            value = (getattr(next(iter(bound.arguments.values())), "__name__", None) if by == BY_NAME
                     else bound.arguments[by])
            if value not in checks:
                raise ValueError(f"{name}: {self.lab.rsplit('.', 1)[-1]} has no check of {value!r}; it checks "
                                 f"{', '.join(map(str, checks))}")
            chosen = checks[value]
        chosen = chosen if isinstance(chosen, tuple) else (chosen,)
        taken = {by} | {p for c in chosen for p in c.params}
        graded = [v for k, v in bound.arguments.items() if k not in taken]
        return [(c, {p: bound.arguments[p] for p in c.params}, graded[0] if len(graded) == 1 else tuple(graded))
                for c in chosen]
