"""minidist.memory: ActivationMeter, the one exact count of what autograd keeps for backward,
LiveBytes, every byte on a device held throughout a phase, and CreatedBytes, the
temporaries a piece of code creates.

Single process, hand-sized tensors: every expected number below is worked out from the
shapes, so a counter that charges a whole storage for a slice, counts overlapping views
twice, counts weights, or never releases would fail.
"""
import importlib
import threading

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.memory import ActivationMeter, CreatedBytes, LiveBytes, Metered, peak_bytes, saved_activation_bytes
from minidist.runtime import launch


def test_slices_of_one_batch_count_their_own_rows():
    x = torch.randn(8, 4, requires_grad=True)
    meter = ActivationMeter()
    outs = []
    for part in x.chunk(4):                 # micro-batches: views into one storage
        with meter.recording():
            outs.append(part.exp())         # exp saves its output (own storage, 2·4·4 bytes)
            outs.append(part * part)        # mul saves both operands: the slice, once
    assert meter.bytes == meter.peak_bytes == 4 * (2 * 4 * 4 + 2 * 4 * 4)
    assert meter.peak_calls == 4


def test_overlapping_views_count_their_union_once():
    qkv = torch.randn(2, 3, 12, requires_grad=True).clone()
    q, k, v = qkv.split(4, dim=-1)          # interleaved, non-contiguous views of one buffer
    _, saved = saved_activation_bytes(lambda: (q * k, v * v))
    assert saved == qkv.numel() * 4


def test_parameters_and_buffers_are_not_activations():
    lin = nn.Linear(5, 7)
    lin.register_buffer("scale", torch.ones(7))
    x = torch.randn(3, 5, requires_grad=True)
    _, saved = saved_activation_bytes(lambda inp: (lin(inp) * lin.scale).tanh(), x, exclude=lin)
    assert saved == 3 * 5 * 4 + 3 * 7 * 4   # linear's input (for dW) and tanh's output; not W, not scale


def test_bool_masks_count_one_byte_per_element():
    x = torch.randn(10, requires_grad=True)
    mask = torch.rand(10) > 0.5
    _, saved = saved_activation_bytes(lambda: x.masked_fill(mask, 0.0))
    assert saved == 10


def test_backward_releases_and_the_peak_remains():
    block = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    meter = ActivationMeter(block.parameters())
    staged = Metered(block, meter)
    ys = [staged(torch.randn(2, 4)) for _ in range(3)]
    one = 2 * 4 * 4 + 2 * 6 * 4     # first linear's input; tanh's output, which is also the second's input
    assert (meter.bytes, meter.peak_calls) == (3 * one, 3)
    ys[0].sum().backward()
    assert meter.bytes == 2 * one
    del ys
    assert (meter.bytes, meter.peak_bytes, meter.peak_calls) == (0, 3 * one, 3)


def test_live_bytes_is_what_a_phase_holds_throughout_on_every_thread():
    meter, kept = LiveBytes(), []
    with meter.recording():
        with meter.phase("made"):
            kept.append(torch.zeros(1000))            # 4000 B, kept past the phase
            transient = torch.zeros(5000)             # freed inside the phase: never held throughout
            del transient
        with meter.phase("kept"):
            torch.zeros(10)
        with meter.phase("freed elsewhere"):
            other = threading.Thread(target=kept.clear)     # freed on a thread the profiler does not watch
            other.start()
            other.join()
            torch.zeros(10)                           # an event on this thread after the free
        with meter.phase("after"):
            torch.zeros(10)
    assert meter.held == {"made": 0, "kept": 4000, "freed elsewhere": 0, "after": 0}


def test_live_bytes_counts_a_buffer_kept_for_reuse_in_every_later_phase():
    meter, cache = LiveBytes(), {}
    with meter.recording():
        for step in range(2):
            with meter.phase(f"step {step}"):
                cache.setdefault("buffer", torch.zeros(500))      # 2000 B, allocated once
                torch.zeros(10)
    assert meter.held == {"step 0": 0, "step 1": 2000}       # held throughout: from the step after it was made


def test_created_bytes_count_new_storages_until_their_last_view_is_gone():
    kept = torch.zeros(64)
    with CreatedBytes() as meter:
        kept.add_(1)                            # in place: nothing created
        kept[:8].mul_(2)                        # a view of what was there before: nothing
        a = torch.empty(100)                    # 400 bytes
        rows = a.view(10, 10)[2:5]              # a view: the same 400 bytes, not more
        b = a * 2                               # 400 more: peak 800
        del a, b
        assert meter.bytes == 400               # `rows` still holds a's storage
        del rows
        assert meter.bytes == 0
        c = torch.cat([kept, kept])             # 512
        with CreatedBytes.paused():
            torch.ones(1000).sum()              # not counted
    assert (meter.peak, meter.bytes) == (800, 512)
    del c
    assert meter.bytes == 0


def _gather_every_way():
    world = dist.get_world_size()
    flat, shard = torch.zeros(6 * world), torch.full((6,), float(dist.get_rank()))
    with CreatedBytes() as into_place:
        dist.all_gather_into_tensor(flat, shard)                      # the output exists: nothing created
        dist.all_gather(list(flat.chunk(world)), shard)
    with CreatedBytes() as into_new:
        full = torch.empty(6 * world)                                  # a second copy of `flat`
        dist.all_gather_into_tensor(full, shard)
        flat.copy_(full)
    return into_place.peak, into_new.peak, flat.tolist()


def test_created_bytes_leave_out_what_a_collective_fills_in_place():
    for into_place, into_new, flat in launch(_gather_every_way, 2, timeout=30):
        assert (into_place, into_new) == (0, 6 * 2 * 4)
        assert flat == [0.0] * 6 + [1.0] * 6


def test_the_allocator_meters_read_the_device_they_are_given_else_the_ranks(monkeypatch):
    """peak_bytes and LiveBytes measure one device's allocator, the rank's by default
    (``minidist.device()``): a rank on another device does not see these CPU bytes."""
    x = torch.ones(1 << 16)

    def work():
        return (x * 2).sum()                # a 256 KiB temporary on the CPU

    def held(meter):                        # 256 KiB made inside the recording, held through the phase
        with meter.recording():
            z = x + 1
            with meter.phase("p"):
                z += 1
        return meter.held["p"]

    assert peak_bytes(work)[1] >= x.nbytes                  # outside a launch the rank's device is the CPU
    monkeypatch.setattr(importlib.import_module("minidist.runtime.device"), "_rank_device", torch.device("meta"))
    assert peak_bytes(work)[1] == 0 and held(LiveBytes()) == 0
    assert held(LiveBytes("cpu")) >= x.nbytes
