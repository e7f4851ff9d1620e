"""The confirmation's warm start (autograder/confirm/warm.py): what a fork of the parent keeps and what it
draws afresh, and which modules the parent imports for it."""
import os
import random

from autograder.confirm import warm, wire


def forked(target, keep=()):
    """Run ``target`` in a fork of this process; what it sent on its stdout (one wire frame)."""
    pid, to_child, from_child = warm.fork(target, set(keep))
    os.close(to_child)
    try:
        return wire.recv(from_child, 60)
    finally:
        os.close(from_child)
        os.waitpid(pid, 0)


def report_fds_and_seed():
    wire.send(1, {"fds": sorted(int(f) for f in os.listdir("/proc/self/fd")), "draw": random.random(),
                  "stdin": wire.recv(0, 5)})


def test_a_fork_keeps_only_its_pipes_stderr_and_the_imports_descriptors():
    secret_r, secret_w = os.pipe()            # stands for the grader's descriptor: the fork must not have it
    library = os.open(os.devnull, os.O_RDONLY)      # stands for one the imports opened: kept
    try:
        got = forked(report_fds_and_seed, keep={library})
    finally:
        for fd in (secret_r, secret_w, library):
            os.close(fd)
    listing = set(got["fds"]) - {0, 1, 2, library}
    assert len(listing) <= 1, got                 # at most the listing's own descriptor
    assert secret_r not in got["fds"] and secret_w not in got["fds"]
    assert got["stdin"] is None                   # its stdin is the parent's new pipe (closed here: end of stream)


def test_every_fork_draws_its_own_seeds():
    random.seed(1234)                             # a parent's state, which two forks must not share
    draws = {forked(report_fds_and_seed)["draw"] for _ in range(3)}
    assert len(draws) == 3


def test_the_parent_imports_only_torch_and_minidist_modules_the_lab_cells_name():
    setup = ["import torch\nimport torch.distributed as dist\nimport numpy as np\nimport helper\n"
             "from minidist.checks import lab4_pipeline as checks\nfrom minidist.models import MLP\n"
             "from . import sibling\n", "this is not python"]
    assert warm.modules(setup) == ["minidist.checks", "minidist.checks.lab4_pipeline", "minidist.models",
                                   "minidist.models.MLP", "torch", "torch.distributed"]
    # what is not minidist's or torch's is never imported, even if asked for
    assert not warm._ours("helper") and not warm._ours("os") and not warm._ours("minidist.x-y")
