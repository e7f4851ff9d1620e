"""Stand-ins: the notebook's other functions that a graded one calls, replaced inside the ranks by the
library's own (or thin adapters over it), so that a wrong ``f`` costs ``f``'s points and not those of
every function built on it (labs 3, 5, 6 and 9).

A lab declares its stand-ins once (:class:`StandIns`); each test of a graded function (or, lab 3, of a
stage) gets from it the functions to rebind (:meth:`StandIns.rebound`, applied in the rank by
:func:`stand_in_lab_functions`) and its refusal (:meth:`StandIns.refusal`): the lab's, with the library
code those stand-ins run allowed, never the graded function's own (an adapter pasted as the answer
calls refused code and earns nothing).
"""
from __future__ import annotations

import dataclasses

from minidist.checks.kit.refusal import Refusal
from minidist.checks.kit.student_code import is_student_code


@dataclasses.dataclass(frozen=True)
class StandIns:
    """``table``: {the notebook's name: (stand-in, the library code it is[, the library code its backward
    needs besides])}, each a qualified name under ``prefix``; ``calls``:
    {test: the notebook's names a test stands in for} (default: every name of the table but the test's own)."""
    table: dict
    calls: dict | None = None
    prefix: str = ""

    def names(self, test) -> tuple:
        """The notebook's names a test of ``test`` stands in for."""
        return tuple(self.calls[test]) if self.calls is not None else tuple(n for n in self.table if n != test)

    def rebound(self, test) -> dict:
        """{the notebook's name: its stand-in} for a test of ``test``, rebound inside the ranks."""
        return {name: self.table[name][0] for name in self.names(test)}

    def refusal(self, refused: Refusal, test) -> Refusal:
        """``refused``, with the library code of the test's stand-ins allowed: what they are, and what their
        backward needs unless that is the code of ``test``'s own stand-in (lab 5: f's test refuses CopyToTP,
        which the column-parallel layer's backward needs)."""
        own = set(self.table[test][1]) if test in self.table else set()
        allow = []
        for name in self.names(test):
            code, needs = self.table[name][1], self.table[name][2] if len(self.table[name]) > 2 else ()
            allow += [self.prefix + c for c in code] + [self.prefix + c for c in needs if c not in own]
        return refused.allowing(*dict.fromkeys(allow))


def stand_in_lab_functions(fn, stand_ins: dict) -> None:
    """Inside a rank: the notebook's other lab functions that ``fn`` calls by name become
    ``stand_ins`` ({name: minidist's or the lab's reference}), so a test grades one function
    and not the ones it builds on. For a class (lab 3's ``Zero``), the globals its ``__init__``
    runs in: its methods call the lab's functions by name there. Only a student's function or
    class is touched (its module globals are the notebook's); never call this in the process that
    grades, only in its ranks."""
    fn = getattr(fn, "__init__", None) if isinstance(fn, type) else fn
    names = getattr(fn, "__globals__", None) if callable(fn) and hasattr(fn, "__code__") else None
    if names is None or not is_student_code(fn.__code__.co_filename):
        return
    for other, ref in stand_ins.items():
        if other in names:
            names[other] = ref
