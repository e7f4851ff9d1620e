"""Measured memory: what a rank actually holds, not what a formula says it should.

Four measurements, to set next to the formulas in :mod:`minidist.cost`:

* :func:`model_state_bytes` (:mod:`.states`) — bytes of the *storages* behind the live
  parameter, gradient and optimizer-state tensors: the ZeRO formula's three categories.
* :func:`peak_bytes` and :class:`LiveBytes` (:mod:`.allocator`) — the CPU allocator's own count of
  live bytes, every tensor of every thread: the peak while a function runs, and what the process
  holds throughout each named phase of a run (a buffer kept for reuse counts).
* :class:`CreatedBytes` (:mod:`.created`) — the bytes of the tensors that the code run under it
  creates and still holds, and their peak: the temporaries of one function, without the
  communication backend's own buffers.
* :class:`ActivationMeter` (:mod:`.activations`) — the bytes autograd keeps for backward
  (saved-tensor hooks), per forward call, exactly: what the activation-memory formulas of
  pipeline and tensor parallelism predict. :func:`saved_activation_bytes` is its one-call form.
  It is the only such counter: the pipeline executor, the lab checks, the tour and the tests use it.
"""
from minidist.memory.activations import ActivationMeter, Metered, model_state, saved_activation_bytes
from minidist.memory.allocator import LiveBytes, peak_bytes
from minidist.memory.created import CreatedBytes
from minidist.memory.states import model_state_bytes, optimizer_state_tensors, storage_bytes

__all__ = ["ActivationMeter", "CreatedBytes", "LiveBytes", "Metered", "model_state", "model_state_bytes",
           "optimizer_state_tensors", "peak_bytes", "saved_activation_bytes", "storage_bytes"]
