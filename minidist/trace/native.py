"""The other roads to a collective: ``ProcessGroup`` methods and functional collectives.

``dist.all_reduce(x)`` is one way in. ``dist.group.WORLD.allreduce([x])``, a backend's
``allreduce``, or a raw function reached around the wrapper (``from torch.distributed import
all_reduce`` before it, a closure cell) all call the ``ProcessGroup`` (or ``Backend``) method;
``torch.distributed._functional_collectives`` (and DTensor, which is built on it) calls the
``torch.ops._c10d_functional`` operators, forward and backward. Both layers are traced here under
the ``torch.distributed`` name of the op (``allreduce`` -> ``all_reduce``, a send -> ``isend``),
with its input bytes, so a guard refuses them as it refuses ``dist.all_reduce`` and an answer
written with them is counted like one written with ``dist.*``. A call made inside another traced
call on the same thread (``dist.all_reduce`` -> ``ProcessGroup.allreduce``) is that call: one event.

Not covered: the C++ operators themselves (``torch.ops.c10d.allreduce_``, an
``OpOverload``'s ``.default``), which no Python wrapper can reach.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minidist.trace import state
from minidist.trace.calls import call, caller, check_guard, global_rank, nbytes

#: ProcessGroup / Backend method -> (the torch.distributed name it is traced as, index of its input)
METHODS = {
    "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0), "reduce": ("reduce", 0), "scatter": ("scatter", 0),
    "allgather": ("all_gather", 1), "allgather_coalesced": ("all_gather", 1), "gather": ("gather", 1),
    "_allgather_base": ("all_gather_into_tensor", 1), "all_gather_single": ("all_gather_into_tensor", 1),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor", 1),
    "all_gather_single_coalesced": ("all_gather_into_tensor", 1),
    "reduce_scatter": ("reduce_scatter", 1), "_reduce_scatter_base": ("reduce_scatter_tensor", 1),
    "reduce_scatter_single": ("reduce_scatter_tensor", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor", 1),
    "alltoall": ("all_to_all", 1), "alltoall_base": ("all_to_all_single", 1),
    "all_to_all_single": ("all_to_all_single", 1),
    "barrier": ("barrier", None), "monitored_barrier": ("monitored_barrier", None),
    "send": ("isend", 0), "recv": ("irecv", 0), "recv_anysource": ("irecv", 0),
}
#: torch.ops namespace -> {operator: the torch.distributed name it is traced as}; input first,
#: the group (name or object) last among the positional arguments, a peer second (isend/irecv).
FUNCTIONAL = {
    "_c10d_functional": {
        "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
        "all_reduce_coalesced_": "all_reduce", "broadcast": "broadcast", "broadcast_": "broadcast",
        "all_gather_into_tensor": "all_gather_into_tensor", "all_gather_into_tensor_out": "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
        "reduce_scatter_tensor": "reduce_scatter_tensor", "reduce_scatter_tensor_out": "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor", "all_to_all_single": "all_to_all_single",
        "isend": "isend", "irecv": "irecv", "batch_p2p_ops": "batch_isend_irecv",
    },
    "_c10d_functional_autograd": {
        "all_gather_into_tensor": "all_gather_into_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
        "all_to_all_single": "all_to_all_single",
    },
}


def _group(group):
    """The process group a call runs on, or None for the default group (as ``dist.*(group=None)``)."""
    if isinstance(group, str):
        try:
            group = c10d._resolve_process_group(group)
        except (RuntimeError, ValueError, KeyError):
            return None
    return None if group is None or group is c10d._world.default_pg else group


def _method(method: str, name: str, position: int | None, raw):
    def traced(self, *args, **kwargs):
        if state.per_thread("depth"):       # inside dist.all_reduce & co: that call is the event
            return raw(self, *args, **kwargs)
        where = caller()
        check_guard(name, where)
        group = _group(self) if isinstance(self, dist.ProcessGroup) else None
        peer = None
        if name in ("isend", "irecv") and method != "recv_anysource" and len(args) > 1:
            peer = global_rank(group, args[1])
        payload = args[position] if position is not None and len(args) > position else None
        return call(name, lambda *a, **k: raw(self, *a, **k), args, kwargs, where=where, size=nbytes(payload),
                    peer=peer, group=group, meta={"via": f"{type(self).__name__}.{method}"})

    traced.__name__ = traced.__qualname__ = method
    traced.__doc__ = raw.__doc__
    traced.__minidist_traced__ = True
    return traced


class _TracedOperator:
    """A ``torch.ops`` operator packet whose calls are traced; everything else (``.default``,
    schemas, overloads) is the packet's own."""

    def __init__(self, packet, name: str, namespace: str, op: str):
        self._packet, self._name, self._via = packet, name, f"torch.ops.{namespace}.{op}"

    def __call__(self, *args, **kwargs):
        if state.per_thread("depth"):
            return self._packet(*args, **kwargs)
        where = caller()
        check_guard(self._name, where)
        group = next((_group(a) for a in reversed(args) if isinstance(a, (str, dist.ProcessGroup))), None)
        payload = args[3] if self._name == "batch_isend_irecv" else args[0] if args else None
        peer = global_rank(group, args[1]) if self._name in ("isend", "irecv") else None
        return call(self._name, self._packet, args, kwargs, where=where, size=nbytes(payload), peer=peer,
                    group=group, meta={"via": self._via})

    def __getattr__(self, attr):
        return getattr(self._packet, attr)


def install() -> None:
    for cls in (dist.ProcessGroup, torch._C._distributed_c10d.Backend):
        for method, (name, position) in METHODS.items():
            raw = cls.__dict__.get(method)
            if raw is not None and not getattr(raw, "__minidist_traced__", False):
                setattr(cls, method, _method(method, name, position, raw))
    for namespace, ops in FUNCTIONAL.items():
        ns = getattr(torch.ops, namespace)
        for op, name in ops.items():
            try:
                packet = getattr(ns, op)
            except (AttributeError, RuntimeError):      # not in this torch
                continue
            if not isinstance(packet, _TracedOperator):
                setattr(ns, op, _TracedOperator(packet, name, namespace, op))
