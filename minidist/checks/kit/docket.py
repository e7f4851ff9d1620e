"""The docket: every answer a check's run files, for the grader's judge.

In the grader's confirmation the student's answers are made in the child that ran the solution cells,
where code a solution cell left behind (a thread, a patched module) runs next to the comparison. So
the verdict is given again elsewhere: :func:`minidist.checks.kit.run.run` files every answer, as plain
data, in this list, at an index it computes (the case's; for a check on groups of ranks, case × world
+ rank). The confirmation's runner holds the list from before any student code (:func:`entries`) and
sends it with the test's reply; the judge (``autograder/confirm/judge.py``, a process that never runs
student code) gives every verdict again from it (:meth:`minidist.checks.kit.check.Check.judge`). A case
with no answer filed is a failure, so only right answers pass. Answers are filed only where
``MINIDIST_DOCKET=1`` (the runner sets it), read once at import; a test's answers are at most
:data:`minidist.protocol.DOCKET_MAX_BYTES`.
"""
from __future__ import annotations

import json
import os

from minidist.protocol import DOCKET_ENV, DOCKET_MAX_BYTES

#: Whether answers are filed (the grader's confirmation). Read once, before any student code.
ON = os.environ.get(DOCKET_ENV) == "1"
_entries: list = []          # (key, params key, case index, plain data bytes) filed since the runner emptied it
_size = [0, 0]               # [entries, bytes] of the docket when last counted (a running total)
MAX_BYTES = DOCKET_MAX_BYTES   # a test's answers past this are not filed: the test fails in the confirmation


def params_key(params: dict) -> str:
    """A check's params as the docket keys them (the test cell gives them as constants)."""
    return json.dumps({k: params[k] for k in sorted(params)})


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
