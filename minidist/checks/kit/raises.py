"""A case whose call must raise ValueError, and before any message: the lab's contract for bad input
("bad input gets a clear error before any collective starts"; a rank that communicated first would
leave its peers waiting).

* :func:`outcome` (in this process) and :func:`attempt` (inside a rank, traced) are answers: what the
  call did, as plain data;
* :func:`raise_verdict` is the verdict on either: a ValueError, raised before any message.
"""
from __future__ import annotations

from typing import Callable

from minidist.trace import trace


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


def attempt(fn, args, kwargs=None) -> dict:
    """Inside a rank: :func:`outcome` of ``fn(*args, **kwargs)`` and the operations it traced."""
    with trace() as tr:
        done = outcome(lambda: fn(*args, **(kwargs or {})))
    return {**done, "communicated": sorted({e.op for e in tr.comm()})}


def raise_verdict(answer: dict, what: str) -> str | None:
    """The verdict on an :func:`outcome` or :func:`attempt`: a ValueError, raised before any message
    (where the answer traced its messages), because ``what``."""
    if answer.get("raised") == "ValueError":
        sent = answer.get("communicated") or []
        return None if not sent else (
            f"raised ValueError only after communicating ({', '.join(sent)}): check {what} first, before any "
            "message (the other ranks would wait for you)")
    if "raised" in answer:
        return (f"raised {answer['raised']} ({str(answer.get('message'))[:120]}) although {what}; the lab asks for "
                "a ValueError with a clear message, before any message")
    return f"returned although {what}; the lab asks for a ValueError"
