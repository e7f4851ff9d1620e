"""The allocator's own count of live bytes on one device: every tensor of every thread, whoever holds it.

Both meters measure the device the model and its tensors live on (default: this rank's,
``minidist.device()``): the CUDA caching allocator's statistics on a GPU, c10's CPU allocator
on the CPU. Each decides that in one place, keyed on the device (never on the backend).

* :func:`peak_bytes` — the peak of live memory while a function runs. On GPU,
  ``torch.cuda.max_memory_allocated``; on CPU, the profiler's allocation timeline
  (every allocation and free, in order), whose running total is the live-memory curve.
* :class:`LiveBytes` — every byte of tensors on the device that the process holds throughout each
  named phase of a run (forward, backward, step): a buffer kept for reuse counts, which
  :func:`minidist.memory.model_state_bytes`, reading only the states, does not see. Read from the
  profiler's allocation events of that device (the CUDA allocator reports its running total to
  the profiler as the CPU allocator does).
"""
from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager

import torch

from minidist.runtime.device import device as rank_device


PHASE = "minidist.phase:"      # the record_function names of LiveBytes' phases


def _on(dev: torch.device | str | None) -> torch.device:
    """The device a meter reads: the one asked for, else this rank's; ``cuda`` means the current GPU."""
    dev = torch.device(dev) if dev is not None else rank_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _timeline(prof, dev: torch.device) -> tuple[list[tuple[int, int, int]], list[tuple[str, int, int]]]:
    """From a profile taken with profile_memory=True: (time, signed size, the allocator's running
    total after it) of every allocation and free recorded on ``dev``, in time order, and (name,
    start, end) of every LiveBytes phase."""
    from torch._C._profiler import _EventType
    events, phases, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == dev.type and \
                (dev.index is None or node.extra_fields.device.index == dev.index):
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        elif node.name.startswith(PHASE):
            phases.append((node.name[len(PHASE):], node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    return sorted(events, key=lambda e: e[0]), phases


@contextmanager
def _every_thread_counted():
    """c10's CPU allocator keeps its running total of live bytes (the one profiler events carry)
    for every thread only with FLAGS_caffe2_report_cpu_memory_usage; otherwise a tensor freed on
    a thread the profiler does not watch (gloo frees a collective's buffers on its own threads)
    stays counted for ever. The flag has no Python binding: set it through the library's symbol."""
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
                                    "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as err:
        raise RuntimeError(f"counting CPU memory needs c10's FLAGS_caffe2_report_cpu_memory_usage: {err}") from None
    before, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = before


def peak_bytes(fn, *args, device: torch.device | str | None = None, **kwargs) -> tuple[object, int, int]:
    """Run ``fn``; return (its result, peak bytes above the level at the start, net change) on
    ``device`` (default: ``minidist.device()``).

    The net change is what ``fn`` left allocated (e.g. gradients created during a step),
    so ``states_after - net + peak`` is the absolute peak when ``states_after`` is what
    the rank holds at the end. On CPU the level is the allocator's running total, which
    counts every thread's frees (gloo's included); it is read at the allocations and frees
    of the calling thread.
    """
    device = _on(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base, torch.cuda.memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    with _every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    events = _timeline(prof, device)[0]
    if not events:
        return result, 0, 0
    start = events[0][2] - events[0][1]
    return result, max(0, max(total for _, _, total in events) - start), events[-1][2] - start


class LiveBytes:
    """Every byte of tensors on ``device`` (default: ``minidist.device()``) this process holds
    throughout each named phase of a run.

    ``with meter.recording(): ... with meter.phase("step"): ...``; afterwards ``meter.held[name]``
    is the least that was live while the phase ran (the most of those, if it ran several times),
    counted from where the recording began: what the phase held from start to end, every tensor
    of every thread whoever holds it (a buffer kept for reuse counts). The least, not the level at
    one moment: gloo's threads free a finished collective's buffers a little later, and at one
    moment those would count or not depending on the load. The level is the device allocator's
    own running total, read from the profiler's allocation events on that device.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = _on(device)
        self.held: dict[str, int] = {}

    @contextmanager
    def recording(self):
        from torch.profiler import ProfilerActivity, profile
        # Python's cycle collector frees garbage (an earlier model and its hooks) whenever it
        # runs: inside the recording, those frees would land at random and move the level.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with _every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                yield self
        finally:
            if was_enabled:
                gc.enable()
        events, phases = _timeline(prof, self.device)
        start = events[0][2] - events[0][1] if events else 0
        for name, begin, end in phases:
            level = [total for t, _, total in events if t < begin][-1:] or [start]
            held = min(level + [total for t, _, total in events if begin <= t <= end]) - start
            self.held[name] = max(held, self.held.get(name, held))

    @staticmethod
    def phase(name: str):
        return torch.profiler.record_function(PHASE + name)
