"""``torch.distributed``'s functions (``dist.send``, ``dist.all_reduce``, ...), wrapped once per process.

Wrapped at the module attribute of both ``torch.distributed`` and ``distributed_c10d`` (P2POp and
``batch_isend_irecv`` look isend/irecv up in the latter), so code must call ``dist.send(...)``;
``from torch.distributed import send`` made before the wrapping gets the raw function, which
still reaches the ``ProcessGroup`` methods that :mod:`.native` traces. The wrapper keeps the
function's name, docs and signature but not ``__wrapped__``, which would hand out the raw op.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minidist.trace import state
from minidist.trace.calls import call, caller, check_guard, nbytes, short
from minidist.trace.events import COLLECTIVES, P2P_OPS, P2P_SEND, PEER_ARG

# Collectives whose input is the second argument (the first is the output buffer).
INPUT_SECOND = {"all_gather", "all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor",
                "all_gather_into_tensor", "reduce_scatter_single", "all_gather_single"}


def _payload(name: str, args, kwargs):
    if name in INPUT_SECOND:
        return args[1] if len(args) > 1 else kwargs.get(
            "input_list", kwargs.get("input", kwargs.get("input_tensor", kwargs.get("tensor"))))
    return args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("tensor_list")))


def wrap(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if state.per_thread("depth"):   # called by another traced op (e.g. all_gather_object -> all_gather)
            return fn(*args, **kwargs)
        where = caller()
        check_guard(name, where)
        if name == "batch_isend_irecv":     # its isend/irecv are traced one by one instead
            batch = state.per_thread("batch")
            batch.append(name)              # ... and never rewritten: NCCL returns one work for the group
            try:
                return fn(*args, **kwargs)
            finally:
                batch.pop()
        group = kwargs.get("group")
        peer = None
        if name in PEER_ARG:
            peer = kwargs.get(PEER_ARG[name], args[1] if len(args) > 1 else None)
            gpeer = kwargs.get("group_" + PEER_ARG[name])
            if peer is None and gpeer is not None and group is not None:
                peer = dist.get_global_rank(group, gpeer)
        if peer is not None and peer == dist.get_rank():
            raise ValueError(f"rank {peer} called {name}() with itself as the peer ({short(where)}): "
                             f"a rank cannot {'send to' if name in P2P_SEND else 'receive from'} itself")
        size = nbytes(_payload(name, args, kwargs))
        land = None
        if state.async_rewriters and not state.per_thread("batch"):
            rewritten = state.async_rewriters[-1](name, fn, args, kwargs, short(where))
            if rewritten is not None:
                args, kwargs, land = rewritten
        return call(name, fn, args, kwargs, where=where, size=size, peer=peer, group=group,
                    tag=kwargs.get("tag", 0), land=land)

    del traced.__wrapped__                  # would reach the raw op, past the guard
    traced.__signature__ = inspect.signature(fn)
    traced.__minidist_traced__ = True
    return traced


def install() -> None:
    for name in sorted(P2P_OPS | COLLECTIVES):
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__minidist_traced__", False):
            continue
        wrapped = wrap(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
