"""Context parallelism (minidist.context_parallel), measured, not asserted.

Every distributed case of one world size runs inside ONE ``minidist.launch`` (results
cached per world size), as in tests/test_tensor_parallel.py. Each rank builds the full
q, k, v from the same seed, runs single-process attention
(``torch.nn.functional.scaled_dot_product_attention``, fp64) on them, runs the
context-parallel version on its shard, and returns numbers; the tests assert on them:

* output, LSE and dq/dk/dv equal the reference for P in {1, 2, 3, 4}: fp64 within 1e-10,
  fp32 within 1e-5 (relative to the largest value of the whole reference tensor where that
  exceeds 1; the reference is fp64 on the very inputs, rounded to the dtype), causal
  and not, contiguous and zigzag shards, MHA / GQA (split and replicated) / MQA, and with
  inputs scaled so that a naive exp overflows;
* traced messages equal ``minidist.cost`` exactly (kind, count, payload bytes per phase),
  ring attention talks to its two ring neighbours only, Ulysses only all-to-alls;
* per-rank attention work (the kernel's spans) equals the formulas, and zigzag balances it;
* the ring's sends are in flight while a block is computed (``overlap=True``), not with
  ``overlap=False``; the ring completes when every isend/irecv blocks until matched;
* two context-parallel groups of 2 inside 4 ranks; every ValueError before any message.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minidist
from minidist import cost
from minidist.context_parallel import (all_to_all, heads_to_seq, hybrid_attention, hybrid_shard, local_attention,
                                       merge_partial_attention, new_hybrid_groups, ring_attention, seq_to_heads, shard,
                                       shard_positions, ulysses_attention, unshard, zigzag_shard)
from minidist.models import repeat_kv
from minidist.tensor_parallel import new_tp_group
from minidist.trace import trace
from conftest import attempt

B, H, D, LOCAL = 2, 12, 4, 6          # 12 heads: split or replicated kv for P = 1..4; shards of 6 tokens
KV_HEADS = (12, 6, 4, 3, 2, 1)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
WORLDS = [1, 2, 3, 4]


# ============================================================================= helpers (run in ranks)
def _err(a, b, whole=None) -> float:
    """Max |a − b|, relative to the largest |value| of the ``whole`` reference tensor (of
    which b is a shard) where that exceeds 1, as for the whole tensor on one process."""
    a, b = a.detach().double(), b.detach().double()
    top = (b if whole is None else whole.detach().double()).abs().max()
    return ((a - b).abs().max() / top.clamp(min=1.0)).item()


def _full(seq, n_kv, seed, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seq, H, D, generator=g, dtype=torch.float64) * q_scale
    k, v = (torch.randn(B, seq, n_kv, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(B, seq, H, D, generator=g, dtype=torch.float64)


def _reference(q, k, v, w, causal):
    """SDPA output, gradients for the upstream gradient w, and the LSE (b, h, s)."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True).transpose(1, 2)
    (out * w).sum().backward()
    scores = qh @ repeat_kv(kh, H // kh.size(1)).transpose(-2, -1) / D ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return out.detach(), (q.grad, k.grad, v.grad), torch.logsumexp(scores, -1).detach()


def _phase(tr) -> dict:
    comm = tr.comm()
    return {"sends": sorted((e.op, e.nbytes) for e in comm if e.op in ("isend", "all_to_all_single")),
            "ops": sorted({e.op for e in comm}), "peers": sorted({(e.op, e.peer) for e in comm if e.peer is not None}),
            "groups": sorted({e.group for e in comm}, key=str)}


def _work(tr) -> tuple[int, int]:
    blocks = [e.meta for e in tr.events if e.op == "span:attention block"]
    return sum(m["unmasked"] for m in blocks), sum(m["rows"] * m["cols"] for m in blocks)


def _case(group, kind, dtype, causal, zigzag, n_kv, seed=0, q_scale=1.0, overlap=True, keep_events=False):
    r, p = dist.get_rank(group), dist.get_world_size(group)
    # the reference sees exactly our inputs (rounded to dtype first), computed in fp64
    q, k, v, w = (x.to(dtype).double() for x in _full(LOCAL * p, n_kv, seed, q_scale))
    ref, ref_grads, ref_lse = _reference(q, k, v, w, causal)
    cut = lambda x: shard(x, r, p, zigzag).to(dtype)                 # noqa: E731
    mine = [cut(x).requires_grad_() for x in (q, k, v)]
    with trace() as fwd:
        if kind == "ring":
            out, lse = ring_attention(*mine, causal, group, zigzag=zigzag, overlap=overlap, return_lse=True)
            want_lse = ref_lse[:, :, shard_positions(LOCAL * p, r, p, zigzag)]
        else:
            out, lse = ulysses_attention(*mine, causal, group, return_lse=True)
            want_lse = ref_lse[:, r * H // p:(r + 1) * H // p]
    with trace() as bwd:
        (out * cut(w)).sum().backward()
    err = {"out": _err(out, cut(ref), ref), "lse": _err(lse, want_lse, ref_lse),
           **{f"d{n}": _err(x.grad, cut(g), g) for n, x, g in zip("qkv", mine, ref_grads)}}
    top = (q.transpose(1, 2) @ repeat_kv(k.transpose(1, 2), H // n_kv).transpose(-2, -1)).max().item() / D ** 0.5
    return {"err": err, "max_score": top, "forward": _phase(fwd), "backward": _phase(bwd), "work": _work(fwd),
            "fwd_events": fwd.events if keep_events else None}


def _ulysses_ok(n_kv, p):
    return n_kv % p == 0 or p % n_kv == 0


def _case_errors(group):
    p = dist.get_world_size(group)
    x = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype)   # noqa: E731
    q = x(B, 4, H, D)
    cases = {
        "3-D q": lambda: ring_attention(x(4, H, D), q, q, group=group),
        "dtype mismatch": lambda: ring_attention(q, q.double(), q.double(), group=group),
        "k and v shapes": lambda: ulysses_attention(q, q, x(B, 4, H, D + 1), group=group),
        "head_dim": lambda: ring_attention(q, x(B, 4, H, D + 1), x(B, 4, H, D + 1), group=group),
        "heads not a multiple of kv heads": lambda: ring_attention(q, x(B, 4, 5, D), x(B, 4, 5, D), group=group),
        "ring shard lengths": lambda: ring_attention(q, x(B, 5, H, D), x(B, 5, H, D), group=group),
        "zigzag odd shard": lambda: ring_attention(x(B, 3, H, D), x(B, 3, H, D), x(B, 3, H, D), True, group,
                                                   zigzag=True),
        "all_to_all same dims": lambda: all_to_all(q, 2, 2, group),
        "merge shapes": lambda: merge_partial_attention(x(2, 3), x(2), x(2, 4), x(2)),
        "zigzag sequence": lambda: zigzag_shard(x(1, 2 * p + 1), 0, p),
    }
    if p > 1:
        cases |= {
            "ulysses heads % P": lambda: ulysses_attention(*(x(B, 4, p + 1, D),) * 3, group=group),
            "ulysses kv heads neither split nor replicated": lambda: ulysses_attention(
                x(B, 4, 12 * p, D), *(x(B, 4, {2: 3, 3: 2, 4: 6}[p], D),) * 2, group=group),
            "all_to_all indivisible": lambda: all_to_all(x(B, 4, p + 1, D), 2, 1, group),
        }
    return {name: attempt(fn) for name, fn in cases.items()}


def _case_all_to_all(group):
    """seq_to_heads / heads_to_seq move exactly the right elements, forward and backward."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    full = torch.arange(B * 2 * p * H * D, dtype=torch.float64).view(B, 2 * p, H, D)
    mine = full.tensor_split(p, 1)[r].clone().requires_grad_()
    heads = seq_to_heads(mine, group)
    back = heads_to_seq(heads, group)
    (heads * heads).sum().backward()           # d/dx of Σ x² is 2x, wherever x went
    return max(_err(heads, full.tensor_split(p, 2)[r]), _err(back, mine), _err(mine.grad, 2 * mine))


def _blocking(group):
    """Every isend/irecv made blocking: the ring must still complete (NCCL's strictest case)."""
    send, recv, isend, irecv = dist.send, dist.recv, dist.isend, dist.irecv

    class Done:
        def wait(self):
            return True

    dist.isend = lambda t, dst=None, group=None, tag=0, **kw: (send(t, dst=dst, group=group, tag=tag), Done())[1]
    dist.irecv = lambda t, src=None, group=None, tag=0, **kw: (recv(t, src=src, group=group, tag=tag), Done())[1]
    try:
        return _case(group, "ring", torch.float64, True, True, 2, seed=5)["err"]
    finally:
        dist.isend, dist.irecv = isend, irecv


def _suite():
    group, out = None, {}
    p = dist.get_world_size()
    for dtype in (torch.float64, torch.float32):
        for causal in (False, True):
            for n_kv in KV_HEADS:
                if dtype == torch.float32 and n_kv not in (12, 2, 1):
                    continue
                for zigzag in (False, True):
                    out["ring", dtype, causal, zigzag, n_kv] = _case(group, "ring", dtype, causal, zigzag, n_kv)
                if _ulysses_ok(n_kv, p):
                    out["ulysses", dtype, causal, False, n_kv] = _case(group, "ulysses", dtype, causal, False, n_kv)
    for dtype, q_scale in ((torch.float64, 3000.0), (torch.float32, 100.0)):    # scores far past exp's range
        for kind in ("ring", "ulysses"):
            out["overflow", kind, dtype] = _case(group, kind, dtype, True, kind == "ring", 2 if p != 3 else 3,
                                                 seed=3, q_scale=q_scale)
    for overlap in (True, False):
        out["overlap", overlap] = _case(group, "ring", torch.float64, False, False, 4, overlap=overlap,
                                        keep_events=True)
    out["all_to_all"] = _case_all_to_all(group)
    out["errors"] = _case_errors(group)
    if p > 1:
        out["blocking"] = _blocking(group)
    return out


def _case_hybrid(ulysses, ring, causal, zigzag, n_kv):
    """2D: Ulysses in groups of 2 ([0, 1], [2, 3]), the ring across them ([0, 2], [1, 3])."""
    u, n_u = dist.get_rank(ulysses), dist.get_world_size(ulysses)
    r, n_r = dist.get_rank(ring), dist.get_world_size(ring)
    q, k, v, w = _full(LOCAL * n_u * n_r, n_kv, seed=20)
    ref, ref_grads, _ = _reference(q, k, v, w, causal)
    cut = lambda x: hybrid_shard(x, r, n_r, u, n_u, zigzag)        # noqa: E731
    mine = [cut(x).requires_grad_() for x in (q, k, v)]
    with trace() as tr:
        out = hybrid_attention(*mine, causal, ulysses, ring, zigzag=zigzag)
        (out * cut(w)).sum().backward()
    err = max([_err(out, cut(ref), ref)] + [_err(x.grad, cut(g), g) for x, g in zip(mine, ref_grads)])
    want = cost.hybrid_collectives(B, LOCAL * n_u * n_r, H, D, n_r, n_u, n_kv, elem_bytes=8)
    return err, _phase(tr)["sends"], sorted((c.op, c.nbytes) for c in want), _phase(tr)["groups"]


def _subgroup_suite():
    """World of 4 cut into context-parallel groups [0, 1] and [2, 3], each on its own data;
    then the same 4 ranks as a 2 x 2 grid for 2D (Ulysses x ring) attention."""
    group = new_tp_group(2)
    seed = 10 + dist.get_rank() // 2
    out = {"ring": _case(group, "ring", torch.float64, True, True, 2, seed=seed),
           "ulysses": _case(group, "ulysses", torch.float64, True, False, 2, seed=seed),
           "ranks": dist.get_process_group_ranks(group)}
    ulysses, ring = new_hybrid_groups(2)
    out["hybrid groups"] = (dist.get_process_group_ranks(ulysses), dist.get_process_group_ranks(ring))
    for causal, zigzag, n_kv in ((False, False, 4), (True, False, 12), (True, True, 2), (True, True, 1)):
        out["hybrid", causal, zigzag, n_kv] = _case_hybrid(ulysses, ring, causal, zigzag, n_kv)
    return out


@functools.lru_cache(maxsize=None)
def run(p: int) -> list[dict]:
    return minidist.launch(_suite, p, timeout=120)


@functools.lru_cache(maxsize=None)
def run_subgroups() -> list[dict]:
    return minidist.launch(_subgroup_suite, 4, timeout=120)


def _cases(p, kind):
    for rank, res in enumerate(run(p)):
        for key, value in res.items():
            if isinstance(key, tuple) and key[0] == kind:
                yield rank, key, value


def _expected(kind, p, n_kv, dtype):
    e = torch.finfo(dtype).bits // 8
    if kind == "ring":
        return cost.ring_attention_messages(B, LOCAL * p, n_kv, D, p, elem_bytes=e)
    return cost.ulysses_collectives(B, LOCAL * p, H, D, p, h_kv=n_kv, elem_bytes=e)


def _sends(collectives, phase):
    return sorted((c.op, c.nbytes) for c in collectives if c.phase == phase)


# ============================================================================= tests
@pytest.mark.parametrize("p", WORLDS)
def test_equal_to_single_process_attention(p):
    for kind in ("ring", "ulysses"):
        seen = 0
        for rank, key, res in _cases(p, kind):
            dtype = key[1]
            for what, err in res["err"].items():
                assert err <= TOL[dtype], f"P={p} rank {rank} {key}: {what} differs by {err:.3g}"
            seen += 1
        assert seen >= (4 if kind == "ulysses" else 8) * p, (kind, seen)


@pytest.mark.parametrize("p", WORLDS)
def test_equal_when_a_naive_exp_overflows(p):
    for rank, (_, kind, dtype), res in _cases(p, "overflow"):
        top = torch.tensor(res["max_score"], dtype=dtype)
        assert torch.isinf(torch.exp(top)), f"the case must overflow a naive exp: max score {top}"
        for what, err in res["err"].items():
            assert err <= TOL[dtype], f"P={p} rank {rank} {kind} {dtype}: {what} differs by {err:.3g}"


@pytest.mark.parametrize("p", WORLDS)
def test_traced_messages_equal_the_formulas(p):
    for kind in ("ring", "ulysses"):
        for rank, (_, dtype, _, _, n_kv), res in _cases(p, kind):
            expected = _expected(kind, p, n_kv, dtype)
            for phase in ("forward", "backward"):
                assert res[phase]["sends"] == _sends(expected, phase), (p, rank, kind, n_kv, dtype, phase)
            if kind == "ring" and p > 1:
                nxt, prv = (rank + 1) % p, (rank - 1) % p
                for phase in ("forward", "backward"):
                    assert res[phase]["ops"] == ["irecv", "isend"]
                    assert res[phase]["peers"] == sorted({("isend", nxt), ("irecv", prv)}), res[phase]["peers"]
            elif kind == "ulysses" and p > 1:
                assert res["forward"]["ops"] == res["backward"]["ops"] == ["all_to_all_single"]
            else:
                assert res["forward"]["sends"] == res["backward"]["sends"] == []


def test_gqa_and_mqa_cut_ring_and_ulysses_traffic():
    p = 4
    by = {}
    for kind in ("ring", "ulysses"):
        for _, (_, dtype, causal, zigzag, n_kv), res in _cases(p, kind):
            if dtype == torch.float64 and not causal and not zigzag:
                by[kind, n_kv] = sum(n for _, n in res["forward"]["sends"] + res["backward"]["sends"])
    assert by["ring", 12] == 12 * by["ring", 1] and by["ring", 12] == 6 * by["ring", 2]      # only kv travels
    # Ulysses: q and out always move all h heads; kv shrink to h_kv, but never below P replicas
    assert by["ulysses", 12] > by["ulysses", 4] == by["ulysses", 2] == by["ulysses", 1]
    assert by["ulysses", 1] == sum(c.nbytes for c in cost.ulysses_collectives(B, LOCAL * p, H, D, p, 1, 8))


@pytest.mark.parametrize("p", WORLDS)
def test_per_rank_attention_work_equals_the_formulas_and_zigzag_balances_it(p):
    for causal in (False, True):
        for zigzag in (False, True):
            useful, computed = [], []
            for rank in range(p):
                res = run(p)[rank]["ring", torch.float64, causal, zigzag, 12]
                useful.append(res["work"][0])
                computed.append(res["work"][1])
            seq = LOCAL * p
            want = cost.causal_scores(seq, p, zigzag) if causal else [seq * seq // p] * p
            assert useful == want, (causal, zigzag, useful, want)
            assert computed == cost.ring_computed_scores(seq, p, causal, zigzag), (causal, zigzag, computed)
            if causal and zigzag:
                assert cost.imbalance(useful) <= 1.05 and cost.imbalance(computed) == 1.0
            if causal and not zigzag and p > 1:
                assert cost.imbalance(useful) > 1.3


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_sends_the_next_block_while_computing_this_one(p):
    """With overlap, each pass's isend is posted before the block's compute starts and
    waited for after it ends; without, it has completed before the compute starts."""
    for rank in range(p):
        for overlap in (True, False):
            events = run(p)[rank]["overlap", overlap]["fwd_events"]
            sends = [e for e in events if e.op == "isend"]
            blocks = [e for e in events if e.op == "span:attention block"]
            assert len(sends) == p - 1 and len(blocks) == p
            for send, block in zip(sends, blocks):
                if overlap:
                    assert send.start <= block.start and block.end <= send.end
                else:
                    assert send.end <= block.start


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_completes_when_every_p2p_op_blocks_until_matched(p):
    for rank, res in enumerate(run(p)):
        assert max(res["blocking"].values()) <= 1e-10, (rank, res["blocking"])


@pytest.mark.parametrize("p", WORLDS)
def test_all_to_all_forward_and_backward(p):
    for rank, res in enumerate(run(p)):
        assert res["all_to_all"] <= 1e-12


@pytest.mark.parametrize("p", WORLDS)
def test_every_value_error_comes_before_any_message(p):
    for rank, res in enumerate(run(p)):
        for name, (kind, message, sent) in res["errors"].items():
            assert kind == "ValueError", f"P={p} rank {rank} {name}: {kind}: {message}"
            assert sent == 0, f"P={p} rank {rank} {name}: {sent} collectives before the error"


def test_context_parallel_groups_of_two_inside_four_ranks():
    for rank, res in enumerate(run_subgroups()):
        mine = [0, 1] if rank < 2 else [2, 3]
        assert res["ranks"] == mine
        for kind in ("ring", "ulysses"):
            assert max(res[kind]["err"].values()) <= 1e-10, (rank, kind, res[kind]["err"])
            for phase in ("forward", "backward"):
                assert res[kind][phase]["groups"] == [tuple(mine)]
                assert res[kind][phase]["sends"] == _sends(_expected(kind, 2, 2, torch.float64), phase)
        other = mine[1 - mine.index(rank)]
        assert res["ring"]["forward"]["peers"] == [("irecv", other), ("isend", other)]


def test_2d_ulysses_inside_groups_ring_across_them():
    for rank, res in enumerate(run_subgroups()):
        assert res["hybrid groups"] == ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2])
        for key, (err, sends, want, groups) in ((k, v) for k, v in res.items() if k[0] == "hybrid"):
            assert err <= 1e-10, (rank, key, err)
            assert sends == want, (rank, key)
            assert groups == sorted({tuple(g) for g in res["hybrid groups"]}, key=str), groups


# ============================================================================= no launch
def test_merge_is_stable_where_the_naive_formula_overflows():
    g = torch.Generator().manual_seed(0)
    scores = 1e4 * torch.randn(3, 10, generator=g, dtype=torch.float64)
    v = torch.randn(10, 2, generator=g, dtype=torch.float64)

    def part(cols):
        lse = torch.logsumexp(scores[:, cols], -1)
        return torch.exp(scores[:, cols] - lse[:, None]) @ v[cols], lse

    out, lse = merge_partial_attention(*part(slice(0, 4)), *part(slice(4, 10)))
    whole, whole_lse = part(slice(0, 10))
    assert _err(out, whole) <= 1e-12 and _err(lse, whole_lse) <= 1e-12
    assert not torch.isfinite(torch.exp(whole_lse)).all()          # e^lse itself overflows here


def test_local_attention_equals_sdpa_and_shards_round_trip():
    q, k, v, w = _full(12, 3, seed=1)
    for causal in (False, True):
        ref, grads, ref_lse = _reference(q, k, v, w, causal)
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = local_attention(*mine, causal)
        (out * w).sum().backward()
        assert max(_err(out, ref), _err(lse, ref_lse), *(_err(x.grad, g) for x, g in zip(mine, grads))) <= 1e-12
    for p in (1, 2, 3):
        for zigzag in (False, True):
            assert torch.equal(unshard([shard(q, r, p, zigzag) for r in range(p)], zigzag), q)
    assert shard_positions(8, 1, 2, zigzag=True).tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 0, 2, zigzag=True).tolist() == [0, 1, 6, 7]


def test_contiguous_causal_sharding_is_far_off_balance():
    for p in (2, 4, 8):
        assert cost.imbalance(cost.causal_scores(4096, p, zigzag=True)) == 1.0
        assert cost.imbalance(cost.causal_scores(4096, p)) == pytest.approx(2 - 1 / p, rel=1e-3)


def test_bench_rows_carry_traced_bytes_equal_to_theory():
    import argparse

    from minidist.benchmarks import context_parallel as bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    rows = bench.run(parser.parse_args(["--seqs", "16", "--heads", "4", "--kv-heads", "2", "--head-dim", "4",
                                        "--steps", "1"]))
    assert [r["impl"] for r in rows] == list(bench.IMPLS)
    for r in rows:
        assert r["bytes_per_rank"] == r["bytes_theory"] > 0 and r["step_ms"] > 0, r
