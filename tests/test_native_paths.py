"""Every road from Python to a collective is traced and guarded, and torch's own users of them
(DTensor, DeviceMesh, loss_parallel, object collectives) are counted once.

``dist.all_reduce`` is one road; ``ProcessGroup`` methods, a backend's methods, the raw function
behind the wrapper, functional collectives (forward and backward) and ``torch.distributed.nn``
are the others. Each is checked three ways in one 2-rank launch: its result, the event it records
(op, bytes), and a guard that forbids it.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
import torch.nn.functional as F

import minidist
from minidist.trace import ForbiddenOperation, guard, trace

N = 2


def _roads(x):
    """name -> a call that all-reduces (or moves) x, by one road each; every one returns the result."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.nn.functional as dnn
    world = dist.group.WORLD
    peer = 1 - dist.get_rank()

    def p2p():
        got = torch.empty_like(x)
        works = [world.send([x], peer, 0), world.recv([got], peer, 0)]
        [w.wait() for w in works]
        return got

    def closure():                    # the raw c10d function, fished out of the wrapper
        raw = next(c.cell_contents for c in dist.all_reduce.__closure__ if callable(c.cell_contents))
        y = x.clone()
        raw(y)
        return y

    def nn_functional():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return dnn.all_reduce(x.clone())

    def backend():
        y = x.clone()
        world._get_backend(torch.device("cpu")).allreduce([y]).wait()
        return y

    return {
        "ProcessGroup.allreduce": lambda: (lambda y: (world.allreduce([y]).wait(), y)[1])(x.clone()),
        "default group, one tensor": lambda: (lambda y: (c10d._get_default_group().allreduce(y).wait(), y)[1])(x.clone()),
        "Backend.allreduce": backend,
        "ProcessGroup.send/recv": p2p,
        "raw function from the closure": closure,
        "funcol.all_reduce": lambda: funcol.all_reduce(x, "sum", world).wait(),
        "funcol.all_gather_single": lambda: funcol.all_gather_single(x, 0, world).wait(),
        "torch.distributed.nn": nn_functional,
    }


EXPECTED = {    # road -> (events (op, bytes) for a 4-float x, result from x = rank + 1 on each rank)
    "ProcessGroup.allreduce": ([("all_reduce", 16)], [3.0] * 4),
    "default group, one tensor": ([("all_reduce", 16)], [3.0] * 4),
    "Backend.allreduce": ([("all_reduce", 16)], [3.0] * 4),
    "ProcessGroup.send/recv": ([("isend", 16), ("irecv", 16)], None),
    "raw function from the closure": ([("all_reduce", 16)], [3.0] * 4),
    "funcol.all_reduce": ([("all_reduce", 16)], [3.0] * 4),
    "funcol.all_gather_single": ([("all_gather_into_tensor", 16)], [1.0] * 4 + [2.0] * 4),
    "torch.distributed.nn": ([("all_reduce", 16)], [3.0] * 4),
}


def _every_road():
    import torch.distributed._functional_collectives as funcol
    rank = dist.get_rank()
    x = torch.full((4,), float(rank + 1))
    out = {"__wrapped__": hasattr(dist.all_reduce, "__wrapped__")}
    for name, road in _roads(x).items():
        with trace() as t:
            result = road()
        refused = None
        try:
            with guard(allow={"barrier"}, why="no collectives here"):
                road()
        except ForbiddenOperation as err:
            refused = str(err)
        out[name] = ([(e.op, e.nbytes) for e in t.comm()], result.tolist(), refused,
                     {e.peer for e in t.comm()})

    # functional collectives' backward: all_gather forward, reduce_scatter backward, both counted
    w = torch.full((2,), float(rank + 1), requires_grad=True)
    with trace() as fwd:
        gathered = funcol.all_gather_single(w, 0, dist.group.WORLD).wait()
    with trace() as bwd:
        (gathered * torch.arange(1.0, 5.0)).sum().backward()
    out["autograd"] = ([(e.op, e.nbytes) for e in fwd.comm()], [(e.op, e.nbytes) for e in bwd.comm()],
                       w.grad.tolist())

    with trace() as t:
        objs = [None]
        dist.broadcast_object_list(objs if rank else [{"from": 0}], src=0)
    out["objects"] = [e.op for e in t.comm()]
    return out


def test_every_road_to_a_collective_is_traced_and_guarded():
    for rank, out in enumerate(minidist.launch(_every_road, N)):
        assert out["__wrapped__"] is False
        for name, (events, result) in EXPECTED.items():
            got_events, got, refused, peers = out[name]
            assert got_events == events, (rank, name)
            assert got == (result if result is not None else [float(2 - rank)] * 4), (rank, name)
            op = events[0][0]
            assert refused is not None and refused.startswith(f"{op} is not allowed here"), (rank, name, refused)
            if name == "ProcessGroup.send/recv":
                assert peers == {1 - rank}
        fwd, bwd, grad = out["autograd"]
        assert fwd == [("all_gather_into_tensor", 8)] and bwd == [("reduce_scatter_tensor", 16)]
        # d/dw of sum(k * gathered[k]) summed over both ranks: rank r's w sits at k = 2r, 2r+1
        assert grad == ([2.0, 4.0] if rank == 0 else [6.0, 8.0])
        assert out["objects"] == ["broadcast_object_list"]          # once, not again for its inner ops


def _dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    mesh = init_device_mesh("cpu", (N,))
    mlp = parallelize_module(nn.Sequential(*[m for m in _copy(ref)]), mesh,
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 8)
    with trace() as t:
        y = mlp(x)
    out = {"mlp": ([(e.op, e.nbytes, e.meta.get("via", "")) for e in t.comm()], (y - ref(x)).abs().max().item())}

    classifier = nn.Linear(8, 6)          # logits sharded over the classes, as loss_parallel wants them
    head = parallelize_module(_copy(classifier), mesh, ColwiseParallel(use_local_output=False))
    target = torch.randint(0, 6, (5,))
    with trace() as t, loss_parallel():
        loss = F.cross_entropy(head(x), target)
        loss.backward()
    out["loss_parallel"] = ([e.meta.get("via", "dist") for e in t.comm()],
                            abs(loss.full_tensor().item() - F.cross_entropy(classifier(x), target).item()))
    return out


def _copy(module):
    import copy
    return copy.deepcopy(module)


def test_dtensor_device_mesh_and_loss_parallel_work_and_are_counted_once():
    for out in minidist.launch(_dtensor, N, timeout=120):
        events, err = out["mlp"]
        assert err < 1e-5
        # Rowwise's partial sums, all-reduced once: 5 x 6 floats, by the functional op and not again
        assert events == [("all_reduce", 5 * 6 * 4, "torch.ops._c10d_functional.all_reduce")]
        vias, loss_err = out["loss_parallel"]
        assert loss_err < 1e-5 and vias
        assert all(v.startswith("torch.ops._c10d_functional") for v in vias), vias
