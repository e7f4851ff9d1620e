"""Running code as a GPU rank sees it, on a machine with no GPU.

On a GPU rank every input lives on ``cuda:<i>``; a tensor made without ``device=`` lands on the
CPU and the next operation that mixes the two fails. Here the inputs stay on ``cpu`` while torch's
default device inside each rank is ``meta`` (``MINIDIST_RANK_DEFAULT_DEVICE``, read by the rank
process after it joined the group), so every allocation that forgot ``device=`` makes a meta
tensor, and using it with a real one raises. Same mistake, same failure, no GPU needed.

A case file (``device_cases_*.py``) maps each public entry point it covers, by qualified name, to
a :class:`Case`: a world size and a body that runs inside a rank, inputs made with
``device=minidist.device()``, forward and backward where the entry point has one, and that raises
when the result is wrong (or is on ``meta``). ``EXEMPT`` maps the names that allocate nothing on a
device (constants, pure arithmetic on ints, dataclasses) to the reason.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from minidist.checks.kit.device_check import backward_on
from minidist.runtime.rank_process import DEFAULT_DEVICE_ENV


@dataclass
class Case:
    world_size: int
    body: Callable[[], object]      # runs in every rank; raises when something is wrong


@contextlib.contextmanager
def meta_default_in_ranks():
    """Inside this block, every rank launched starts its function with ``meta`` as the default device."""
    old = os.environ.get(DEFAULT_DEVICE_ENV)
    os.environ[DEFAULT_DEVICE_ENV] = "meta"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(DEFAULT_DEVICE_ENV, None)
        else:
            os.environ[DEFAULT_DEVICE_ENV] = old


def assert_real(*tensors) -> None:
    """Fails on a tensor that ended up on ``meta`` (made without ``device=``)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise AssertionError("a result is on the meta device: something was made without device=")


@contextlib.contextmanager
def default_device_in_backward():
    """Inside this block, every custom ``autograd.Function`` backward runs with torch's default
    device as it was on entry (``meta`` in these tests), as its forward did: a ``torch.zeros(...)``
    there would otherwise land on the CPU unseen (ring attention's dK/dV accumulator did, and passed)."""
    with backward_on(torch.get_default_device()):
        yield


def run_bodies(bodies: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Inside a rank: run each body in turn, custom backwards included in the default-device
    discipline; name -> the last lines of its traceback, for those that failed."""
    failed = {}
    for name, body in bodies.items():
        try:
            with default_device_in_backward():
                body()
        except Exception:       # noqa: BLE001  (reported by name, the test asserts there are none)
            failed[name] = "".join(traceback.format_exc().splitlines(True)[-6:])
    return failed
