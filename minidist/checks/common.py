"""What every lab's checks share: timeouts, tolerance, and the one way to launch a check.

A check launches the student's code on N ranks once per world size and runs many cases in
that launch (launching costs more than a tiny model). When the launch fails, the student
must learn *which* case was running: every rank writes the case it starts into a progress
folder (:func:`mark_case`), and :func:`launch_named` puts those names in front of the
launcher's diagnosis (which rank was blocked in which operation, on which line). A call to
a forbidden operation (the tracer's guard) becomes an ``AssertionError`` that says so.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from minidist.runtime import LaunchError, launch
from minidist.trace import ForbiddenOperation


def check_timeout(seconds: float) -> float:
    """A check's launch timeout; MINIDIST_CHECK_TIMEOUT overrides it (the grader's quick selftest)."""
    return float(os.environ.get("MINIDIST_CHECK_TIMEOUT", seconds))


COLLECTIVE_CHECK_TIMEOUT = check_timeout(15.0)   # one launch of a lab-1 collective over all its cases
TRAINING_CHECK_TIMEOUT = check_timeout(20.0)     # one launch training a tiny model over all its cases
TOL = 1e-5                                       # fp32 equality with a single-process reference


@contextlib.contextmanager
def one_thread():
    """Tiny models in this process: one intra-op thread (on a busy 2-core machine, two
    threads make a 3-step reference run 100x slower, not faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def mark_case(progress: str, text: str) -> None:
    """Inside a rank: record the case this rank starts now (named if the launch fails)."""
    with open(os.path.join(progress, f"rank{dist.get_rank()}"), "w") as f:
        f.write(text)


def launch_named(body, world_size: int, *args, name: str, timeout: float,
                 forbidden_hint: str = "") -> list:
    """``launch(body, world_size, progress, *args)``; on failure, name the running case(s).

    ``body`` receives the progress folder first and calls :func:`mark_case` per case.
    A forbidden operation raises ``AssertionError`` (with ``forbidden_hint``); any other
    failure re-raises the launcher's ``LaunchError``, prefixed with the function's name,
    the world size and the cases that were running.
    """
    progress = tempfile.mkdtemp(prefix="minidist-check-")
    try:
        return launch(body, world_size, progress, *args, timeout=timeout)
    except LaunchError as err:
        running = set()
        for p in os.listdir(progress):
            with open(os.path.join(progress, p)) as f:
                running.add(f.read())
        running = sorted(running - {""})
        where = f"{name} (world_size={world_size}{', ' if running else ''}{' / '.join(running)})"
        forbidden = [text for text in err.failures.values() if ForbiddenOperation.__name__ in text]
        if forbidden:
            line = forbidden[0].split("ForbiddenOperation: ", 1)[-1].splitlines()[0]
            raise AssertionError(f"{where}: a forbidden operation was called: {line}."
                                 + (f"\n{forbidden_hint}" if forbidden_hint else "")) from None
        hint = ""
        if any("SIGABRT" in text for text in err.failures.values()):     # gloo aborts on a size mismatch
            hint = ("\nHint: a rank crashed inside gloo. The usual cause is a send and its receive of "
                    "different sizes (e.g. a wrong chunk index when chunks differ in length); gloo's own "
                    "message ('Received data size doesn't match expected size') is in the output above.")
        raise LaunchError(f"{where} failed:\n{err}{hint}", err.failures) from None
    finally:
        shutil.rmtree(progress, ignore_errors=True)
