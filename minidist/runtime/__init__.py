"""How ranks start, fail and report: the bottom layer every technique runs on.

``launcher`` (the parent: start N ranks, supervise), ``failure_report`` (what a failed rank's
report says), ``rank_process``
(the child: join the group, run, report), ``torchrun`` (the same call under torchrun).
"""
from minidist.runtime.launcher import LAUNCH_TIMEOUT, LaunchError, import_optimizers_before_fork, launch
from minidist.runtime.torchrun import init_from_env

__all__ = ["launch", "LaunchError", "LAUNCH_TIMEOUT", "init_from_env", "import_optimizers_before_fork"]
