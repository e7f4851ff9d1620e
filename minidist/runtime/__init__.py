"""How ranks start, fail and report: the bottom layer every technique runs on.

``device`` (where a rank's tensors live, which group it joins, timing that waits for them),
``cpu_affinity`` (one core per rank when ranks outnumber the cores),
``launcher`` (the parent: resolve the device, start N ranks, supervise), ``failure_report``
(what a failed rank's report says), ``rank_process`` (the child: bind its device, join the
group, run, report, tear the group down), ``plain_data`` (how a result travels back: never a
pickle), ``torchrun`` (the same call under torchrun).
"""
from minidist.runtime.device import device, synchronize, timed
from minidist.runtime.launcher import LAUNCH_TIMEOUT, LaunchError, import_optimizers_before_fork, launch
from minidist.runtime.torchrun import init_from_env

__all__ = ["device", "synchronize", "timed", "launch", "LaunchError", "LAUNCH_TIMEOUT", "init_from_env", "import_optimizers_before_fork"]
