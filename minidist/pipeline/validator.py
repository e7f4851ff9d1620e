"""Is a schedule runnable? Structure, message matching, and deadlock freedom.

A valid schedule, for every rank and every (micro-batch, chunk) it holds:
  * runs exactly one forward, then either one B or one BI followed by one BW;
    a second forward of the same micro-batch ("holding it twice") is an error;
  * receives its input (RECV_F / RECV_B) before the compute that needs it and sends
    its output (SEND_F / SEND_B) after the compute that makes it, to the right rank;
  * every send is matched by the receive at the same position of the same channel
    (messages between two ranks match in FIFO order, as in NCCL) and vice versa;
  * cannot deadlock. That is decided by running the schedule in the simulator under
    *rendezvous* semantics: a send completes only once its receive is posted. This is
    the strictest model (NCCL may block a send that way); a schedule that finishes
    under it also finishes under any buffering (gloo), so one check covers both.
"""
from __future__ import annotations

from minidist.pipeline.schedules import Schedule
from minidist.pipeline.simulator import simulate
from minidist.pipeline.structure import ScheduleError, structural_problems


def validate(s: Schedule) -> list[str]:
    """All problems of a schedule (empty list = valid), deadlock included."""
    # The simulator is the deadlock checker.
    problems = structural_problems(s)
    if problems:
        return problems
    try:
        simulate(s, check=False)
    except ScheduleError as err:
        return [str(err)]
    return []


def check(s: Schedule) -> Schedule:
    """Raise :class:`ScheduleError` (a ValueError) listing the problems, else return ``s``."""
    problems = validate(s)
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ScheduleError(f"invalid schedule {s.name} (p={s.p}, m={s.m}):\n  "
                            + "\n  ".join(problems[:10]) + more)
    return s
