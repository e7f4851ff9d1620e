"""The second chance, written once: what timed out runs once more with every timeout × 3.

A loaded machine can make an honest launch time out (two kernels and a confirmation on 2 cores);
a deadlock times out at any scale. So a test that timed out in the notebook run, and a test the
confirmation did not confirm, are run again, alone, with every launch timeout and the cell timeout
multiplied by :data:`RETRY_TIMEOUT_SCALE` (the launcher reads ``MINIDIST_TIMEOUT_SCALE`` at each
launch, :mod:`minidist.runtime.launcher`). The environment of the retry is a new dict: nothing is
changed in the grader's own.
"""
from __future__ import annotations

from minidist.protocol import TIMEOUT_SCALE_ENV

RETRY_TIMEOUT_SCALE = 3


def timeout_scale(env) -> float:
    """The launch timeouts' scale in ``env`` (1 where unset)."""
    return float(env.get(TIMEOUT_SCALE_ENV) or 1)


def overrides(env, scale: float = RETRY_TIMEOUT_SCALE) -> dict:
    """The variables that make ``env``'s launch timeouts ``scale`` times longer."""
    return {TIMEOUT_SCALE_ENV: f"{timeout_scale(env) * scale:g}"}


def scaled(env: dict, scale: float = RETRY_TIMEOUT_SCALE) -> dict:
    """A copy of ``env`` whose launch timeouts are ``scale`` times longer."""
    return {**env, **overrides(env, scale)}
