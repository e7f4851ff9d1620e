"""Pipeline parallelism: schedules as data, one validator, one simulator, one executor.

    from minidist.pipeline import make, check, simulate, partition, run_schedule
    s = check(make("1f1b", p=4, m=8))        # per-rank action lists, validated
    simulate(s).bubble                        # 3/11 = (p-1)/(m+p-1)

Files: ``schedules`` (generators), ``validate``, ``simulate``, ``partition``,
``executor`` (runs any valid schedule over send/recv), ``timeline`` (Gantt data from
the simulator or a traced run, measured bubble, Chrome trace, ``measure``), ``tour``
(the ``minidist tour`` rows). Formulas: ``minidist.cost`` section 7; plots:
``minidist.plots``; benchmark: ``minidist bench pipeline``.
"""
from .schedules import (Action, Schedule, SCHEDULES, make, naive, gpipe, one_f_one_b,
                        interleaved_1f1b, zb_h1, with_comms)
from .validate import ScheduleError, validate, check
from .simulate import Costs, Slot, SimResult, simulate
from .partition import partition, balanced_boundaries, rank_chunks
from .executor import StepStats, run_schedule, timed
from .timeline import slots_from_trace, bubble_of, to_chrome, measure

__all__ = ["Action", "Schedule", "SCHEDULES", "make", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zb_h1", "with_comms", "ScheduleError", "validate", "check", "Costs", "Slot", "SimResult",
           "simulate", "partition", "balanced_boundaries", "rank_chunks", "StepStats", "run_schedule", "timed",
           "slots_from_trace", "bubble_of", "to_chrome", "measure"]
