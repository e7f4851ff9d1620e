"""How ranks start, fail and report: the bottom layer every technique runs on.

``launcher`` (the parent: start N ranks, supervise, explain failures), ``rank_process``
(the child: join the group, run, report), ``torchrun`` (the same call under torchrun).
"""
from minidist.runtime.launcher import LAUNCH_TIMEOUT, LaunchError, launch
from minidist.runtime.torchrun import init_from_env

__all__ = ["launch", "LaunchError", "LAUNCH_TIMEOUT", "init_from_env"]
