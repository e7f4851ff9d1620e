"""The device check: a lab's check run once, on one visible case, with torch's default device ``meta``.

On a GPU node every input of a graded function lives on ``cuda:<rank>``, and a tensor made without
``device=`` (``torch.zeros(n)``) lands on the CPU, next to CUDA tensors: a device-mismatch error, or a
silent copy every step. On a laptop the inputs are on the CPU too, so the mistake passes every test.
Here the inputs stay where the check puts them (the CPU) while torch's default device is ``meta``: a
tensor made without ``device=`` has no data, and the first operation that mixes it with a real one
raises, as on a GPU node. The selftest runs every solution this way already (``autograder/selftest/selftest.py``,
``META``); :func:`on_meta` gives the student's own answer the same test, as a visible test cell.

While the answer runs, every factory call of the student's code that names no device (torch's list
of them, the one ``torch.device`` as a context manager uses) is recorded with its line, so a failure
says which line made the tensor, not only where it met a real one. Custom ``autograd.Function``
backwards run under the same default device as their forward (autograd's engine would run them
without it, and a ``torch.zeros`` there would pass unseen).

It judges where tensors are made, and nothing else: when the answer fails (a wrong value, an error of
the student's own, a hang) and no line of the student's code made a tensor without ``device=``, the
device check passes (the answer is its function's own test's to judge; one mistake costs one test).
When such a line exists and the answer failed, it fails, leading with those lines, the consequence
folded into one line ("ranks 0-3 raised: RuntimeError: ..."). A function not written yet (the
release's stub, NotImplementedError) fails it: it has shown nothing.

:func:`on_meta` derives the check from a lab's :class:`~minidist.checks.kit.check.Check`; it goes
through the lab's registry like any check, so the grader's judge gives its verdict again: the base
check's verdict on the answer made under ``meta``, or, where no tensor was made on ``meta``, the
record :data:`MADE_NONE` filed in the answer's place (:func:`device_verdict` accepts it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from minidist.checks.kit.student_code import is_student_code
from minidist.runtime.rank_process import format_frame

META = "meta"
GPU_NODE = ("On a GPU node that tensor would be on the CPU next to CUDA tensors: a device-mismatch error, "
            "or a silent copy every step. Make it where its data lives: device=x.device for an input x "
            "(or minidist.device()).")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


#: what a device check files in the docket for an answer that failed while no line of the student's
#: made a tensor on the default device (per rank for a launched check): its verdict passes it
MADE_NONE = {"device check": "no tensor made on the default device"}


def made_none(answer) -> bool:
    """Whether ``answer`` is the device check's record that no tensor was made on the default device."""
    return answer == MADE_NONE or (isinstance(answer, list) and bool(answer) and all(a == MADE_NONE for a in answer))


def device_verdict(verdict):
    """The device check's verdict: ``verdict`` (the base check's) on an answer made under ``meta``, and
    nothing to say on :data:`MADE_NONE` (where tensors are made was right; the value is not its to judge)."""
    def judged(case, answer):
        return None if made_none(answer) else verdict(case, answer)
    return judged


#: what a device check confirms, unless the lab's rule is another (``rule=``)
ON_INPUTS = "every tensor it made is on its inputs' device"


def on_meta(check, advice: str | None = None, rule: str = ON_INPUTS, **params):
    """The device check of ``check``: its first case for ``params`` (default: the visible ones), run with
    torch's default device ``meta`` where the answer is made (the launched ranks, or this process for a
    ``"here"`` check), judged by ``check``'s own verdict. Name and title end in "device"; no params.
    ``advice``: the failure's last line (default :data:`GPU_NODE`); ``rule``: what the ✓ line says it confirms."""
    given = {p: params.get(p, False if p == "hidden" else None) for p in check.params}
    given = {p: v for p, v in given.items() if v is not None}
    first_case = lambda: check.cases(**given)[:1]       # noqa: E731
    return dataclasses.replace(check, name=f"{check.name} device", title=f"{check.shown} (device check)",
                               cases=first_case, params=(), default_device=META, stop_at_first_failure=False,
                               verdict=device_verdict(check.verdict), device_advice=advice,
                               covered=lambda: "one visible case with torch's default device meta, as a GPU "
                                               f"node sees it: {rule}")


# ----------------------------------------------------------------------------- where the answer runs
class _Made(TorchFunctionMode):
    """Records the student's lines that call a tensor factory without ``device=`` (``lines``: in order,
    each once), then lets the call go on to the default device below it."""

    def __init__(self, lines: list, on_new=None):
        super().__init__()
        self.lines, self.on_new = lines, on_new

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            line = _student_line()
            if line is not None and line not in self.lines:
                self.lines.append(line)
                if self.on_new is not None:
                    self.on_new(line)
        return func(*args, **kwargs)


def _student_line() -> str | None:
    """The line of the student's code that called the factory (torch's own frames skipped), or None when
    the nearest caller outside torch is not the student's (minidist's, the check's)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None or not is_student_code(frame.f_code.co_filename):
        return None
    return format_frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


@contextlib.contextmanager
def backward_on(device):
    """Custom autograd backwards run with ``device`` as their default, as their forward did (the default
    device is a torch-function mode, and autograd's engine runs a custom backward without it)."""
    import torch.autograd.function as autograd_function
    original = autograd_function.BackwardCFunction.apply

    def apply(self, *args):
        with torch.device(device):
            return original(self, *args)

    autograd_function.BackwardCFunction.apply = apply
    try:
        yield
    finally:
        autograd_function.BackwardCFunction.apply = original


@contextlib.contextmanager
def default_device(device: str, lines: list, on_new=None):
    """Inside: torch's default device is ``device`` (custom backwards included), and ``lines`` collects
    the student's lines that made a tensor without ``device=``; restored on exit."""
    with torch.device(device), _Made(lines, on_new), backward_on(device):
        yield


@contextlib.contextmanager
def in_rank(launched: tuple[str, str] | None):
    """Inside a launched rank, for ``launched`` = (device, folder) (:attr:`Record.launched`):
    :func:`default_device`, each recorded line appended to this rank's file in ``folder`` at once (a
    rank that hangs and is killed has still said what it made). Nothing for None."""
    if launched is None:
        yield
        return
    device, folder = launched
    path = os.path.join(folder, f"rank{dist.get_rank()}")

    def write(line):
        with open(path, "a") as f:
            f.write(line.replace("\0", " ") + "\0")

    with default_device(device, [], write):
        yield


class Record:
    """What one run of a device check recorded: its ranks' lines (files in ``folder``, written by
    :func:`in_rank`; ``launched`` is what the launch hands them) and this process's (``here``)."""

    def __init__(self, device: str, folder: str, advice: str | None = None):
        self.device, self.folder, self.here = device, folder, []
        self.advice = advice or GPU_NODE
        self.launched = (device, folder)

    def lines(self) -> list[str]:
        out = list(self.here)
        for name in sorted(os.listdir(self.folder)):
            with open(os.path.join(self.folder, name)) as f:
                out += [line for line in f.read().split("\0") if line and line not in out]
        return out

    def explain(self, shown: str, failure: BaseException) -> str | None:
        """The device check's failure, or None when it passes: it fails when the answer ``failed`` and a
        line of the student's code made a tensor without a device. The lines first, then what the
        tensor did here, folded into one line, then what it would do on a GPU node."""
        lines = self.lines()
        if not lines:
            return None
        made = "\n".join("  " + line.replace("\n", "\n  ") for line in lines)
        return (f"{shown}: your code made {'a tensor' if len(lines) == 1 else 'tensors'} without device= "
                f"(here on 'meta', the default device of this check):\n{made}\n"
                f"What it did here: {consequence(failure)}\n{self.advice}")


def consequence(failure: BaseException) -> str:
    """One line for what a tensor on ``meta`` did: the ranks that raised the same error folded
    ("ranks 0-3 raised RuntimeError: ..."), else the first line of the failure."""
    from minidist.runtime.failure_report import fold_first_lines
    failures = getattr(failure, "failures", None)
    if isinstance(failures, dict) and failures:
        return fold_first_lines(failures)
    text = str(failure).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(failure, AssertionError):
        return first
    return f"raised {type(failure).__name__}: {first}"
