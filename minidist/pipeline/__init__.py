"""Pipeline parallelism: schedules as data, one validator, one simulator, one executor.

    from minidist.pipeline import make, check, simulate, partition, run_schedule
    s = check(make("1f1b", p=4, m=8))        # per-rank action lists, validated
    simulate(s).bubble                        # 3/11 = (p-1)/(m+p-1)

Files: ``schedules`` (generators), ``structure`` (the rules both checkers share),
``validator``, ``simulator``, ``stages`` (cutting a model into stages), ``executor``
(runs any valid schedule over send/recv), ``timeline`` (Gantt data from the simulator or
a traced run, measured bubble, Chrome trace). A traced measurement run:
``minidist.harness.pipeline.measure``; formulas: ``minidist.cost.pipeline``; plots:
``minidist.plots``; tour rows: ``minidist.tour.pipeline``; benchmark: ``minidist bench pipeline``.
"""
from minidist.pipeline.schedules import (Action, Schedule, SCHEDULES, make, naive, gpipe, one_f_one_b,
                                         interleaved_1f1b, zb_h1, with_comms)
from minidist.pipeline.structure import ScheduleError
from minidist.pipeline.validator import validate, check
from minidist.pipeline.simulator import Costs, Slot, SimResult, simulate
from minidist.pipeline.stages import partition, balanced_boundaries, rank_chunks
from minidist.pipeline.executor import StepStats, run_schedule, timed
from minidist.pipeline.timeline import bubble_of, replayed_slots, slots_from_trace, to_chrome

__all__ = ["Action", "Schedule", "SCHEDULES", "make", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zb_h1", "with_comms", "ScheduleError", "validate", "check", "Costs", "Slot", "SimResult",
           "simulate", "partition", "balanced_boundaries", "rank_chunks", "StepStats", "run_schedule", "timed",
           "slots_from_trace", "replayed_slots", "bubble_of", "to_chrome"]
