"""What every lab's checks share: the timeout, tolerance, and the one way to launch a check.

A check launches the student's code on N ranks once per world size and runs many cases in
that launch (launching costs more than a tiny model). When the launch fails, the student
must learn *which* case was running: every rank writes the case it starts into a progress
folder (:func:`mark_case`), and :func:`launch_named` puts those names in front of the
launcher's diagnosis (which rank was blocked in which operation, on which line; when ranks
ran different cases, each rank's on a line of its own). A call to a forbidden operation (the
tracer's guard) becomes an ``AssertionError`` that says so, and so do a library answer
(:mod:`minidist.checks.kit.refusal`) and a receive without a
source, which gloo runs and NCCL cannot (:func:`nccl_point_to_point`). A passing check prints
one line, :func:`report_passed`.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from minidist.checks.kit import device_check
from minidist.checks.kit.refusal import ChecksTampered, LibraryAnswer, Refusal, present_bindings, refusing, resolve
from minidist.protocol import CHECK_TIMEOUT_ENV
from minidist.runtime import LaunchError, launch, strict_async
from minidist.trace import ForbiddenOperation


def check_timeout(seconds: float, at_least: float = 0.0) -> float:
    """A check's launch timeout (``Check.timeout``); MINIDIST_CHECK_TIMEOUT overrides it (the grader's quick
    selftest), down to ``at_least`` (a launch of 8 ranks needs that long to start)."""
    return max(float(os.environ.get(CHECK_TIMEOUT_ENV, seconds)), at_least)


TIMEOUT = check_timeout(20.0)       # one launch of a check over all its cases (a Check may give its own)
TOL = 1e-5                          # fp32 equality with a single-process reference


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


def report_passed(name: str, covered: str, hidden: bool = False) -> None:
    """The one line a passing test cell prints: ``✓ ring_all_reduce (hidden): n=1..4, fp32/fp64 ...``.

    ``covered`` names the cases in a few words (world sizes, dtypes, what was compared), so a
    student sees what a green cell proved. Printed to stdout: nbgrader scores stderr as 0."""
    print(f"\u2713 {name}{' (hidden)' if hidden else ''}: {covered}", flush=True)


def mark_case(progress: str, text: str) -> None:
    """Inside a rank: record the case this rank starts now (named if the launch fails); the case
    before it must have waited for every asynchronous handle it launched."""
    strict_async.check_all_waited()
    with open(os.path.join(progress, f"rank{dist.get_rank()}"), "a") as f:
        f.write(text.replace("\n", " ") + "\n")      # the rank's cases in order: see _running_cases


def launch_named(body, world_size: int, *args, name: str, timeout: float,
                 forbidden_hint: str = "", refuse: "Refusal | None" = None, outputs_at_wait: bool = True,
                 reference=None, device: tuple[str, str] | None = None, max_restarts: int = 0,
                 on_restart=None, ranks_on: str | None = None) -> list:
    """``launch(body, world_size, progress, *args)``; on failure, name the running case(s).

    ``body`` receives the progress folder first and calls :func:`mark_case` per case.
    ``refuse``: the lab's :class:`Refusal`, active on every rank while ``body`` runs (library
    answers fail the check). ``outputs_at_wait``: an asynchronous operation's output lands only
    when its handle is waited for (:mod:`minidist.runtime.strict_async`), so an unwaited handle
    fails on every run, not when a race happens to show; off only where a check measures the
    memory the student's code allocates (the private copies would count). ``reference``: the
    check's own run of the lab's reference in the same rank, before the student's code and
    outside the refusal, ``reference(progress, *args)``; its result reaches ``body`` as the
    keyword argument ``reference`` (a measurement to compare with the student's in the same
    process). ``device``: the device check's (default device, folder) (:mod:`...device_check`): every
    rank runs ``body`` with that default device and records there the lines that made a tensor
    without one. ``max_restarts``, ``on_restart``: :func:`minidist.launch`'s (a check that kills its
    ranks on purpose, lab 10's restart; ``on_restart`` may raise the error it is given to stop);
    ``ranks_on``: its ``device`` (None: a GPU per rank where there are enough). A forbidden
    operation or a library answer raises
    ``AssertionError`` (with ``forbidden_hint``); any other failure re-raises the launcher's
    ``LaunchError``, prefixed with the function's name, the world size and the cases that
    were running.
    """
    __tracebackhide__ = True        # noqa: F841  (IPython: the test cell's line, then the ranks' report)
    progress = tempfile.mkdtemp(prefix="minidist-check-")
    if refuse is not None:
        resolve(refuse)          # once, here: forked ranks inherit it instead of compiling the library each
        present_bindings()       # likewise the snapshot of the bindings graded code must leave alone
    try:
        return launch(_checked_body, world_size, refuse, outputs_at_wait, reference, device, name, body, progress,
                      *args, timeout=timeout, max_restarts=max_restarts, on_restart=on_restart, device=ranks_on)
    except LaunchError as err:
        where = _running_cases(name, world_size, progress)
        for verdict in (LibraryAnswer, ChecksTampered, strict_async.UnwaitedHandle, NcclWouldReject):   # one line
            texts = [text for text in err.failures.values() if f"{verdict.__name__}: " in text]
            if texts:
                line = texts[0].split(f"{verdict.__name__}: ", 1)[-1].splitlines()[0]
                raise AssertionError(f"{where}: {line}") from None
        forbidden = [text for text in err.failures.values() if ForbiddenOperation.__name__ in text]
        if forbidden:
            line = forbidden[0].split("ForbiddenOperation: ", 1)[-1].splitlines()[0]
            raise AssertionError(f"{where}: a forbidden operation was called: {line}."
                                 + (f"\n{forbidden_hint}" if forbidden_hint else "")) from None
        hint = ""
        if any("SIGABRT" in text for text in err.failures.values()):     # gloo aborts on a size mismatch
            hint = ("\nHint: a rank crashed inside gloo. The usual cause is a send and its receive of "
                    "different sizes (e.g. a wrong chunk index when chunks differ in length); gloo's own "
                    "message ('Received data size doesn't match expected size') is quoted above.")
        summary, details, folded = str(err).partition("\n\ndetails: ")   # the hint before the dump
        raise LaunchError(f"{where} failed:\n{summary}{hint}{details}{folded}", err.failures) from None
    finally:
        shutil.rmtree(progress, ignore_errors=True)


def _running_cases(name: str, world_size: int, progress: str) -> str:
    """``name (case)`` naming the case the failure happened in.

    When ranks are in different cases only because some went on after a peer crashed (their
    collective had completed on their side), the failing case is the one the others are still in,
    and every rank has been through it: that case is named, with who went on. Only ranks that
    truly ran different cases get the case of each rank on a line of its own."""
    history = {}
    for p in os.listdir(progress):
        with open(os.path.join(progress, p)) as f:
            cases = f.read().splitlines()
        if cases and p.startswith("rank") and p[4:].isdigit():
            history[int(p[4:])] = cases
    last = {r: cases[-1] for r, cases in history.items()}
    if len(set(last.values())) > 1:
        shared = [c for c in set(last.values()) if all(c in cases for cases in history.values())]
        if len(shared) == 1:            # the earliest case every rank reached, the others went past it
            ahead = sorted(r for r, c in last.items() if c != shared[0])
            who = f"rank {ahead[0]}" if len(ahead) == 1 else f"ranks {', '.join(map(str, ahead))}"
            return f"{_one_case(name, world_size, shared[0])} ({who} had already finished this case)"
        lines = "".join(f"\n  rank {r} was running: {last[r]}" for r in sorted(last))
        return f"{name} (world_size={world_size}; the ranks were in different cases:{lines}\n)"
    return _one_case(name, world_size, next(iter(last.values()), ""))


def _one_case(name: str, world_size: int, running: str) -> str:
    if running.startswith("world_size="):           # the case names it already
        return f"{name} ({running})"
    return f"{name} (world_size={world_size}{', ' + running if running else ''})"


class NcclWouldReject(RuntimeError):
    """Point-to-point code that gloo runs and NCCL does not: a receive without a source."""


@contextlib.contextmanager
def nccl_point_to_point():
    """Inside a rank: ``recv``/``irecv`` without ``src`` raise :class:`NcclWouldReject` (gloo can
    receive from any source, NCCL cannot, so such code would fail on the GPUs the labs run on;
    a send to oneself the tracer refuses already). Chained in front of the tracer's rewriter of
    asynchronous calls, the one hook that sees every call's arguments."""
    from minidist import trace as _trace
    rewriters = _trace._async_rewriters
    below = rewriters[-1] if rewriters else None

    def check(name, fn, args, kwargs, where):
        if name in ("recv", "irecv") and kwargs.get("src", args[1] if len(args) > 1 else None) is None \
                and kwargs.get("group_src") is None:
            raise NcclWouldReject(f"{name}() without src ({where}): NCCL has no receive from any source, so "
                                  f"this code cannot run on GPUs; name the rank you receive from (src=...)")
        return below(name, fn, args, kwargs, where) if below is not None else None

    rewriters.append(check)
    try:
        yield
    finally:
        rewriters.remove(check)


def _checked_body(refusal, at_wait, reference, device, name, body, progress, *args):
    with device_check.in_rank(device):      # as the selftest's meta ranks: from the start, reference included
        before = {} if reference is None else {"reference": reference(progress, *args)}
        with strict_async.outputs_at_wait() if at_wait else contextlib.nullcontext(), refusing(refusal, name), \
                nccl_point_to_point():
            return body(progress, *args, **before)
