"""Collectives and all-reduce variants built from send/recv: results equal torch's on the
same inputs, the traced bytes equal the cost model's, the patterns are the textbook ones,
sub-groups work, and bad input fails before any message is sent.

Each world size is one launch running every function on every case, to keep the suite fast."""
import functools

import pytest
import torch
import torch.distributed as dist

import minidist

from minidist import collectives as C
from minidist import cost
from minidist.trace import Trace, trace

ALL_REDUCES = dict(C.ALL_REDUCES)
ALL_REDUCES["fast_ring_tiny_segments"] = functools.partial(C.fast_ring_all_reduce, segment_bytes=8)
ALL_REDUCES["fast_ring_into_out"] = lambda t, **kw: C.fast_ring_all_reduce(t, out=torch.empty_like(t), segment_bytes=12, **kw)
OTHERS = {   # name -> (call on rank r of n, reference from all inputs for rank r)
    "broadcast": (lambda x, n: C.broadcast(x, n - 1), lambda xs, r, n: xs[n - 1]),
    "reduce": (lambda x, n: C.reduce(x, n // 2), lambda xs, r, n: sum(xs) if r == n // 2 else None),
    "scatter": (lambda x, n: C.scatter(x, n // 2), lambda xs, r, n: xs[n // 2].tensor_split(n)[r]),
    "gather": (lambda x, n: C.gather(x, 0), lambda xs, r, n: torch.cat(xs) if r == 0 else None),
    "all_gather": (lambda x, n: C.all_gather(x), lambda xs, r, n: torch.cat(xs)),
    "reduce_scatter": (lambda x, n: C.reduce_scatter(x), lambda xs, r, n: torch.stack(xs).sum(0).tensor_split(n)[r]),
    "all_to_all": (lambda x, n: C.all_to_all(x), lambda xs, r, n: torch.cat([x.tensor_split(n)[r] for x in xs])),
}
DTYPES = (torch.float32, torch.float64)


def lengths(n):
    return sorted({1, max(1, n - 1), n, 2 * n + 1, 13})


def inputs(n, length, dtype, rank, shape=None):
    g = torch.Generator().manual_seed(97 * n + 13 * length + rank)
    x = torch.randn(length, generator=g, dtype=torch.float64).to(dtype)
    return x.view(shape) if shape else x


def run_everything():
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for length in lengths(n):
        for dtype in DTYPES:
            x = inputs(n, length, dtype, r)
            for name, fn in ALL_REDUCES.items():
                with trace() as t:
                    out[name, length, dtype] = (fn(x), Trace(t.comm()))
            for name, (call, _) in OTHERS.items():
                out[name, length, dtype] = (call(x, n), None)
            assert torch.equal(x, inputs(n, length, dtype, r)), "an input was modified"
    x2d = inputs(n, 6 * n, torch.float32, r, shape=(2 * n, 3))          # any shape: all-reduce keeps it
    out["2d"] = {name: fn(x2d) for name, fn in ALL_REDUCES.items()}
    edge = {"scalar": torch.tensor(r + 1.0), "empty": torch.empty(0), "int64": torch.arange(5) * (r + 1)}
    out["edge"] = {(name, k): fn(v) for name, fn in ALL_REDUCES.items() for k, v in edge.items()}
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def world(request):
    n = request.param
    return n, minidist.launch(run_everything, n, timeout=60)


def test_all_reduces_match_torch_and_agree_bitwise(world):
    n, res = world
    for length in lengths(n):
        for dtype in DTYPES:
            ref = torch.stack([inputs(n, length, dtype, r) for r in range(n)]).sum(0)
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            for name in ALL_REDUCES:
                got = [res[r][name, length, dtype][0] for r in range(n)]
                for r in range(n):
                    assert got[r].dtype == dtype and got[r].shape == ref.shape, (name, r)
                    torch.testing.assert_close(got[r], ref, rtol=tol, atol=tol * n, msg=f"{name} n={n} L={length} rank {r}")
                    assert torch.equal(got[r], got[0]), f"{name}: rank {r} differs from rank 0 (n={n}, L={length})"
    ref2d = torch.stack([inputs(n, 6 * n, torch.float32, r, shape=(2 * n, 3)) for r in range(n)]).sum(0)
    total = n * (n + 1) // 2
    for name in ALL_REDUCES:
        for r in range(n):
            torch.testing.assert_close(res[r]["2d"][name], ref2d, rtol=1e-5, atol=1e-5 * n)
            edge = {k: res[r]["edge"][name, k] for k in ("scalar", "empty", "int64")}
            assert edge["scalar"].shape == () and edge["scalar"].item() == total, name
            assert edge["empty"].shape == (0,), name
            assert torch.equal(edge["int64"], torch.arange(5) * total), name


def test_one_to_many_and_many_to_many_match_torch(world):
    n, res = world
    for length in lengths(n):
        for dtype in DTYPES:
            xs = [inputs(n, length, dtype, r) for r in range(n)]
            for name, (_, reference) in OTHERS.items():
                for r in range(n):
                    want, got = reference(xs, r, n), res[r][name, length, dtype][0]
                    if want is None:
                        assert got is None, f"{name}: rank {r} should return None"
                    else:
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * n, msg=f"{name} n={n} L={length} rank {r}")


def test_traced_bytes_equal_the_cost_model_exactly(world):
    n, res = world
    for length in lengths(n):
        for dtype in DTYPES:
            item = torch.empty((), dtype=dtype).element_size()
            for name in ALL_REDUCES:
                alg = "fast_ring" if name.startswith("fast_ring") else name
                t = [res[r][name, length, dtype][1] for r in range(n)]
                seen = [(t[r].bytes_sent(), t[r].bytes_received()) for r in range(n)]
                assert seen == [tuple(b) for b in cost.allreduce_bytes_per_rank(alg, n, length, item)], (name, n, length)
                if alg in ("ring", "fast_ring"):      # and the closed form, up to chunk rounding
                    for sent, _ in seen:
                        assert abs(sent - cost.ring_bytes_nominal(n, length * item)) <= 2 * item


def _sends(t):
    return [e for e in t.events if e.is_send]


def test_patterns_are_the_textbook_ones(world):
    n, res = world
    length, dtype = 13, torch.float32          # >= n: no empty chunks, so every message is sent
    for r in range(n):
        ring = res[r]["ring", length, dtype][1]
        assert ring.peers_sent_to() <= {(r + 1) % n} and ring.peers_received_from() <= {(r - 1) % n}
        assert len(_sends(ring)) == 2 * (n - 1)
        naive = res[r]["naive", length, dtype][1]
        assert all(0 in (e.rank, e.peer) for e in naive.events)
        halving = res[r]["recursive_halving", length, dtype][1]
        if n & (n - 1) == 0:
            d = [e.peer ^ r for e in _sends(halving)]
            lg = n.bit_length() - 1
            assert d == [1 << k for k in range(lg)] + [1 << k for k in reversed(range(lg))]
        parallel = res[r]["parallel", length, dtype][1]
        assert parallel.peers_sent_to() == set(range(n)) - {r}
        if n > 1 and n & (n - 1) == 0:      # NCCL-safe ordering: in a swap the lower rank sends first
            first = halving.events[0]
            assert first.is_send == (r < first.peer)


def in_subgroups():
    """Two sub-groups of 4 ranks: [1, 3] and [0, 2, 3] (group ranks != global ranks)."""
    r = dist.get_rank()
    out = {}
    for members in ([1, 3], [0, 2, 3]):
        g = dist.new_group(members)
        if r in members:
            x = inputs(len(members), 7, torch.float32, members.index(r))
            with trace() as t:
                res = {name: fn(x, group=g) for name, fn in C.ALL_REDUCES.items()}
                res["broadcast"] = C.broadcast(x, src=len(members) - 1, group=g)
                res["reduce_scatter"] = C.reduce_scatter(x, group=g)
                res["all_gather"] = C.all_gather(x, group=g)
                res["all_to_all"] = C.all_to_all(x, group=g)
            out[tuple(members)] = (res, t.peers_sent_to() | t.peers_received_from())
        dist.barrier()
    return out


def test_group_argument_works_in_sub_groups():
    res = minidist.launch(in_subgroups, 4, timeout=60)
    for members in ([1, 3], [0, 2, 3]):
        m = len(members)
        xs = [inputs(m, 7, torch.float32, i) for i in range(m)]
        total = torch.stack(xs).sum(0)
        for i, r in enumerate(members):
            got, peers = res[r][tuple(members)]
            assert peers <= set(members) - {r}, f"rank {r} talked outside its group {members}: {peers}"
            for name in C.ALL_REDUCES:
                torch.testing.assert_close(got[name], total, msg=f"{name} in group {members}, rank {r}")
            torch.testing.assert_close(got["broadcast"], xs[-1])
            torch.testing.assert_close(got["reduce_scatter"], total.tensor_split(m)[i])
            torch.testing.assert_close(got["all_gather"], torch.cat(xs))
            torch.testing.assert_close(got["all_to_all"], torch.cat([x.tensor_split(m)[i] for x in xs]))
        for r in set(range(4)) - set(members):
            assert tuple(members) not in res[r]


def bad_calls():
    """Every bad call must raise on every rank without sending anything, so the ranks
    can go on to a correct all-reduce afterwards."""
    errors = []
    x = torch.ones(4)
    outsiders = dist.new_group([1])
    calls = [
        lambda: C.ring_all_reduce([1.0, 2.0]),
        lambda: C.recursive_halving_all_reduce(torch.ones(3, dtype=torch.complex64)),
        lambda: C.naive_all_reduce(torch.ones(3, dtype=torch.bool)),
        lambda: C.broadcast(x, src=2),
        lambda: C.reduce(x, dst=-1),
        lambda: C.scatter(x, src=5),
        lambda: C.parameter_server_all_reduce(x, server=7),
        lambda: C.fast_ring_all_reduce(x, segment_bytes=0),
        lambda: C.fast_ring_all_reduce(x, out=x),
        lambda: C.fast_ring_all_reduce(x, out=torch.empty(4, dtype=torch.float64)),
        lambda: C.ring_all_reduce(x, group=outsiders) if dist.get_rank() == 0 else (_ for _ in ()).throw(ValueError("skip")),
    ]
    with trace() as t:
        for call in calls:
            try:
                call()
                errors.append(None)
            except (TypeError, ValueError) as err:
                errors.append(f"{type(err).__name__}: {err}")
    return errors, len(t.comm()), C.ring_all_reduce(x)


def test_bad_input_fails_before_any_communication():
    res = minidist.launch(bad_calls, 2, timeout=30)
    for errors, messages, after in res:
        assert all(errors), f"a bad call did not raise: {errors}"
        assert messages == 0
        torch.testing.assert_close(after, torch.full((4,), 2.0))
    msgs = res[0][0]
    assert "torch.Tensor" in msgs[0] and "complex64" in msgs[1] and "bool" in msgs[2]
    assert "src=2" in msgs[3] and "size 2" in msgs[3] and "dst=-1" in msgs[4]
    assert "segment_bytes" in msgs[7] and "overlap" in msgs[8] and "dtype" in msgs[9] and "not a member" in msgs[10]


def test_bench_rows_are_consistent_and_the_plot_is_drawn(tmp_path):
    from minidist.benchmarks import collectives as bench
    from minidist.plots import plot_busbw
    assert [bench.parse_size(s) for s in ("1K", "64K", "1M", "16M", "100")] == [1024, 65536, 1 << 20, 16 << 20, 100]
    with pytest.raises(ValueError, match="cannot read size"):
        bench.parse_size("12Q")
    rows = bench.measure(2, [1024, 8192], ["native", "ring", "fast_ring"], iters=2, warmup=1,
                         functions={"mine": C.ring_all_reduce.__wrapped__}, models={"mine": "ring"})
    assert [(r["algorithm"], r["bytes"]) for r in rows] == [
        (a, s) for s in (1024, 8192) for a in ("native", "ring", "fast_ring", "mine")]
    for r in rows:
        t = r["time_us"] * 1e-6
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / t / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)    # nccl-tests factor
        assert ("model_us" in r) == (r["algorithm"] != "native")
    fit = cost.fit_alpha_beta([r["bytes"] for r in rows if r["algorithm"] != "native"],
                              [r["time_us"] * 1e-6 for r in rows if r["algorithm"] != "native"],
                              ["ring" if r["algorithm"] == "mine" else r["algorithm"] for r in rows if r["algorithm"] != "native"], 2)
    assert rows[1]["alpha_us"] == pytest.approx(fit.alpha * 1e6)
    path = tmp_path / "busbw.png"
    plot_busbw(rows, path=str(path))
    assert path.stat().st_size > 10_000


class _Done:
    def wait(self, *args, **kwargs):
        return True


def under_blocking_semantics(names, lengths_):
    """Every isend/irecv made blocking (gloo's send waits for the matching receive): the
    strictest model, the one NCCL's stream-ordered p2p can reach. Code whose op order only
    works because ops are asynchronous deadlocks here."""
    send, recv = dist.send, dist.recv
    dist.isend = lambda t, dst=None, group=None, tag=0, **kw: (send(t, dst=dst, group=group, tag=tag), _Done())[1]
    dist.irecv = lambda t, src=None, group=None, tag=0, **kw: (recv(t, src=src, group=group, tag=tag), _Done())[1]
    n, r = dist.get_world_size(), dist.get_rank()
    fns = {**C.ALL_REDUCES, **{k: call for k, (call, _) in OTHERS.items()}}
    out = {}
    for length in lengths_:
        x = inputs(n, length, torch.float32, r)
        for name in names:
            out[name, length] = fns[name](x) if name in C.ALL_REDUCES else fns[name](x, n)
    return out


def naive_sendrecv_ring(names, lengths_):
    dist.isend = lambda t, dst=None, **kw: (dist.send(t, dst=dst), _Done())[1]
    n, r = dist.get_world_size(), dist.get_rank()
    x, y = torch.ones(4), torch.empty(4)
    dist.isend(x, dst=(r + 1) % n).wait()          # everyone posts its send first
    dist.irecv(y, src=(r - 1) % n).wait()
    return y


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_op_order_is_deadlock_free_when_every_op_blocks_until_matched(n):
    names = list(C.ALL_REDUCES) + list(OTHERS)
    res = minidist.launch(under_blocking_semantics, n, names, [n + 2], timeout=20)
    xs = [inputs(n, n + 2, torch.float32, r) for r in range(n)]
    for name in C.ALL_REDUCES:
        torch.testing.assert_close(res[n - 1][name, n + 2], torch.stack(xs).sum(0))
    for name, (_, reference) in OTHERS.items():
        want = reference(xs, 0, n)
        if want is not None:
            torch.testing.assert_close(res[0][name, n + 2], want)


def fast_ring_under_blocking_p2p(cases):
    from minidist.runtime.strict_async import blocking_p2p
    n, r = dist.get_world_size(), dist.get_rank()
    with blocking_p2p():
        return [C.fast_ring_all_reduce(inputs(n, length, torch.float32, r), segment_bytes=seg) for length, seg in cases]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fast_ring_completes_when_every_p2p_op_blocks_until_matched(n):
    """NCCL's send waits for its receive, and at N = 2 the left and the right neighbour are one
    rank: posting every receive first deadlocked there. Lengths give empty chunks (1), unequal
    chunks and, with 4-byte segments, unequal segment counts per chunk."""
    cases = [(1, 4), (2 * n + 1, 4), (4 * n + 3, 8), (13, 1 << 20)]
    res = minidist.launch(fast_ring_under_blocking_p2p, n, cases, timeout=20)
    for i, (length, _) in enumerate(cases):
        want = torch.stack([inputs(n, length, torch.float32, r) for r in range(n)]).sum(0)
        for r in range(n):
            torch.testing.assert_close(res[r][i], want, msg=f"n={n} length={length} rank {r}")


def test_the_blocking_model_does_catch_a_bad_order():
    with pytest.raises(minidist.LaunchError, match="send"):
        minidist.launch(naive_sendrecv_ring, 3, [], [], timeout=2)
