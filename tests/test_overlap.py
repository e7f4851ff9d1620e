"""minidist.overlap: the decomposed all-gather + matmul and matmul + reduce-scatter equal their plain
versions (forward and gradients, 2 and 4 ranks, in sub-groups), send what the ring formula says,
issue each message before the matmul it overlaps (read from the trace), complete when every p2p op
blocks until matched (NCCL's strictest case) and when outputs land only at wait()."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from minidist.cost.overlap import ring_bytes
from minidist.overlap import all_gather_matmul, fused_all_gather_matmul, fused_available, matmul_reduce_scatter
from minidist.runtime.strict_async import blocking_p2p, outputs_at_wait
from minidist.tensor_parallel import new_tp_group, reduce_scatter_along_dim, sequence_parallel_linear
from minidist.trace import trace

B, ROWS, D_IN, D_OUT = 2, 3, 8, 6        # ROWS per rank along the sequence (dim 1)
TOL = 1e-5


def _data(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, ROWS * t, D_IN, generator=g), "w": torch.randn(D_OUT, D_IN, generator=g),
            "b": torch.randn(D_OUT, generator=g), "dy": torch.randn(B, ROWS * t, D_OUT, generator=g),
            "w_row": torch.randn(D_OUT, D_IN, generator=g), "dy_row": torch.randn(B, ROWS, D_OUT, generator=g)}


def _run(fn, inputs, dy):
    leaves = [x.clone().requires_grad_() for x in inputs]
    with trace() as t:
        y = fn(*leaves)
        (y * dy).sum().backward()
    return [y.detach()] + [x.grad for x in leaves], t


def _pair(group=None):
    """Both ops and their plain versions on this rank: (max error per op, traces of the ring versions)."""
    me, t = dist.get_rank(group), dist.get_world_size(group)
    d = _data(t)
    x_shard = d["x"].chunk(t, 1)[me]
    x_row = d["x"] * (me + 1)                   # every rank's own partial input
    out, traces = {}, {}
    ring, traces["ag"] = _run(lambda x, w, b: all_gather_matmul(x, w, b, group), [x_shard, d["w"], d["b"]], d["dy"])
    plain, _ = _run(lambda x, w, b: sequence_parallel_linear(x, w, b, group), [x_shard, d["w"], d["b"]], d["dy"])
    out["ag"] = max((a - b).abs().max().item() for a, b in zip(ring, plain))
    ring, traces["rs"] = _run(lambda x, w: matmul_reduce_scatter(x, w, group), [x_row, d["w_row"]], d["dy_row"])
    plain, _ = _run(lambda x, w: reduce_scatter_along_dim(F.linear(x, w), 1, group), [x_row, d["w_row"]],
                    d["dy_row"])
    out["rs"] = max((a - b).abs().max().item() for a, b in zip(ring, plain))
    return out, traces


def _in_world():
    return _pair()


def _in_subgroups():
    return _pair(new_tp_group(2))[0]


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    return request.param, minidist.launch(_in_world, request.param, timeout=60)


def test_equal_to_the_plain_versions_forward_and_backward(world):
    n, results = world
    for rank, (err, _) in enumerate(results):
        assert err["ag"] <= TOL and err["rs"] <= TOL, (n, rank, err)


def test_equal_in_sub_groups():
    for err in minidist.launch(_in_subgroups, 4, timeout=60):
        assert err["ag"] <= TOL and err["rs"] <= TOL, err


def test_bytes_sent_are_the_ring_formula(world):
    n, results = world
    shard = B * ROWS * D_IN * 4
    for _, traces in results:
        ag = traces["ag"]
        # forward: one ring all-gather of x; backward: x again (for dW) and a ring reduce-scatter of dx
        assert ag.bytes_sent() == ag.bytes_received() == 3 * ring_bytes(shard, n)
        assert ag.op_counts()["isend"] == 3 * (n - 1)
        rs = traces["rs"]
        # forward: the accumulators of y (B·ROWS·D_OUT each); backward: a ring all-gather of dy
        assert rs.bytes_sent() == 2 * ring_bytes(B * ROWS * D_OUT * 4, n)
        assert not {"all_gather_into_tensor", "reduce_scatter_tensor"} & set(ag.op_counts() | rs.op_counts())


def test_each_message_is_issued_before_the_matmul_it_overlaps(world):
    """From the trace alone: in every ring step but the last, the send to the right neighbour and
    the receive from the left are issued before that step's matmul starts, and waited for after it."""
    n, results = world
    for rank, (_, traces) in enumerate(results):
        events = sorted(traces["ag"].events, key=lambda e: e.start)
        matmuls = [e for e in events if e.op == "compute:matmul"]
        assert len(matmuls) == 3 * n                 # forward ring, dW ring, dx ring
        for i, m in enumerate(matmuls):
            # no message beside an all-gather ring's last chunk, nor a reduce-scatter ring's first
            if m.meta["step"] == (n - 1 if i < 2 * n else 0):
                continue
            before = [e for e in events if e.op in ("isend", "irecv") and e.start <= m.start <= e.waited]
            assert {e.op for e in before} == {"isend", "irecv"}, (rank, m.meta)
            assert all(e.peer == (rank + 1) % n for e in before if e.op == "isend")
            assert all(e.peer == (rank - 1) % n for e in before if e.op == "irecv")
            assert all(e.waited >= m.end for e in before)


def _strict():
    """NCCL's strictest p2p (each op blocks until its partner posts), then outputs that land only at wait()."""
    with blocking_p2p():
        blocking = _pair()[0]
    with outputs_at_wait():
        late = _pair()[0]
    return blocking, late


@pytest.mark.parametrize("n", [2, 3, 4])
def test_deadlock_free_when_every_op_blocks_and_correct_when_outputs_land_at_wait(n):
    for blocking, late in minidist.launch(_strict, n, timeout=60):
        assert max(blocking.values()) <= TOL and max(late.values()) <= TOL


def _bad_calls():
    out = {}
    for name, call in {"feature dim": lambda: all_gather_matmul(torch.ones(2, 3), torch.ones(4, 3), dim=-1),
                       "not divisible": lambda: matmul_reduce_scatter(torch.ones(1, 3, 4), torch.ones(2, 4)),
                       "vector": lambda: matmul_reduce_scatter(torch.ones(4), torch.ones(2, 4))}.items():
        with trace() as t:
            try:
                call()
                out[name] = "no error"
            except ValueError as err:
                out[name] = str(err)
        out[name + " traffic"] = len(t.comm())
    return out


def test_bad_input_fails_before_any_message():
    out = minidist.launch(_bad_calls, 2, timeout=30)[0]
    assert "not the feature dim" in out["feature dim"]
    assert "size 3 is not divisible by 2 ranks" in out["not divisible"]
    assert "a scatter dim and a feature dim" in out["vector"]
    assert all(v == 0 for k, v in out.items() if k.endswith("traffic"))


def test_torch_fused_reference_is_refused_on_cpu_with_its_reason():
    x = torch.ones(2, 4)
    ok, why = fused_available(x)
    if ok:
        pytest.skip("this machine has torch's fused ops: tests/test_gpu.py compares against them")
    assert "CUDA-only" in why
    with pytest.raises(RuntimeError, match="CUDA-only"):
        fused_all_gather_matmul(x, torch.ones(3, 4))


def _sequence_first():
    """(s, b, h) activations, gathered along dim 0 (Megatron's layout): each chunk's output is a
    contiguous slice, written in place; the same results as the plain version."""
    me, t = dist.get_rank(), dist.get_world_size()
    d = _data(t)
    x = d["x"].transpose(0, 1).contiguous()                 # (ROWS·t, B, D_IN)
    dy = d["dy"].transpose(0, 1).contiguous()
    ring, _ = _run(lambda x, w, b: all_gather_matmul(x, w, b, dim=0), [x.chunk(t, 0)[me], d["w"], d["b"]], dy)
    plain, _ = _run(lambda x, w, b: sequence_parallel_linear(x, w, b, dim=0), [x.chunk(t, 0)[me], d["w"], d["b"]], dy)
    return max((a - b).abs().max().item() for a, b in zip(ring, plain))


def test_sequence_first_layout_equals_the_plain_version():
    assert max(minidist.launch(_sequence_first, 4, timeout=60)) <= TOL
