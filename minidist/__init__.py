"""minidist: distributed training rebuilt from send/recv, for teaching.

Start here: ``minidist.launch(fn, world_size)`` runs ``fn`` on N ranks;
``minidist.trace`` records who sent what to whom.
"""
from minidist.launch import DEFAULT_TIMEOUT, LaunchError, launch
from minidist.torchrun import init_from_env
from minidist import trace

__all__ = ["launch", "LaunchError", "init_from_env", "trace", "DEFAULT_TIMEOUT"]
__version__ = "0.1.0"
