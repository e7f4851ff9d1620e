"""minidist: distributed training rebuilt from send/recv, for teaching.

Start here: ``minidist.launch(fn, world_size, device=None)`` runs ``fn`` on N ranks (each on
its own GPU when there are enough, else on the CPU); inside a rank ``minidist.device()`` is
where its tensors go; ``minidist.trace`` records who sent what to whom. Layout (each layer imports only
the ones above it in this list):

* ``runtime``, ``trace``, ``models``, ``memory``, ``cost``: the shared bottom layer;
* ``collectives``, ``data_parallel``, ``pipeline``: one package per technique;
* ``harness``: one training/measurement loop per technique;
* ``checks``, ``tour``, ``benchmarks``, ``plots``, ``diagrams``, ``cli``: the top layer.
"""
from minidist import trace
from minidist.runtime import LAUNCH_TIMEOUT, LaunchError, device, init_from_env, launch, synchronize, timed

__all__ = ["launch", "LaunchError", "init_from_env", "device", "synchronize", "timed", "trace", "LAUNCH_TIMEOUT"]
__version__ = "0.1.0"
