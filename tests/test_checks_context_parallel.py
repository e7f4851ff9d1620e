"""Lab 6's checks reject a few realistic bugs (on the property that catches each), and refuse
minidist's own context parallelism while standing it in for the lab's other functions. (The
correct alternatives the lab promises are in solutions/lab6_context_parallel/bugbank.py's
ALTERNATIVES, checked by the selftest.) The functions below are written on top of the notebook's
other functions, which the checks replace by minidist's own inside the ranks (the names below
are placeholders)."""
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.checks import lab6_context_parallel as lab6
from minidist.checks.kit.run import run


def all_to_all(x, scatter_dim, gather_dim, group=None):        # stood in by minidist's
    raise NotImplementedError


def merge_partial_attention(out_a, lse_a, out_b, lse_b):        # stood in by minidist's
    raise NotImplementedError


def _peer(group, r):
    return r if group is None else dist.get_global_rank(group, r)


def _block(q, k, v, causal):
    """(out (b, h, sq, d), lse (b, h, sq)) of one block, as the lab's helper."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.size(2) // k.size(2)
    qh = q.transpose(1, 2).to(acc)
    kh, vh = (x.transpose(1, 2).to(acc).repeat_interleave(g, dim=1) for x in (k, v))
    s = qh @ kh.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ vh, lse


# ------------------------------------------------------------------ bugs
def merge_without_max(out_a, lse_a, out_b, lse_b):
    total = lse_a.exp() + lse_b.exp()
    return (lse_a.exp()[..., None] * out_a + lse_b.exp()[..., None] * out_b) / total[..., None], total.log()


def ring_everyone_sends_first(q, k, v, causal=False, group=None):
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            incoming = torch.empty_like(kv)
            works = [dist.isend(kv, _peer(group, (rank + 1) % p), group=group),
                     dist.irecv(incoming, _peer(group, (rank - 1) % p), group=group)]
        if not causal or src <= rank:
            ob, lb = _block(q, kv[0], kv[1], causal and src == rank)
            out, lse = (ob, lb) if out is None else merge_partial_attention(out, lse, ob, lb)
        if step < p - 1:
            for w in works:
                w.wait()
            kv = incoming
    return out.transpose(1, 2).to(q.dtype), lse


def ring_via_all_gather(q, k, v, causal=False, group=None):
    """Right numbers, wrong algorithm: every rank gathers all K/V at once."""
    p = dist.get_world_size(group)
    parts = [torch.empty_like(k) for _ in range(p)], [torch.empty_like(v) for _ in range(p)]
    dist.all_gather(parts[0], k.contiguous(), group=group)
    dist.all_gather(parts[1], v.contiguous(), group=group)
    rank = dist.get_rank(group)
    ks, vs = torch.cat(parts[0], 1), torch.cat(parts[1], 1)
    s_loc = q.size(1)
    if causal:      # keys up to my last query, masked by global position
        ks, vs = ks[:, :(rank + 1) * s_loc], vs[:, :(rank + 1) * s_loc]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.size(2) // k.size(2)
    qh = q.transpose(1, 2).to(acc)
    kh, vh = (x.transpose(1, 2).to(acc).repeat_interleave(g, dim=1) for x in (ks, vs))
    s = qh @ kh.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        qpos = torch.arange(rank * s_loc, (rank + 1) * s_loc)
        s = s.masked_fill(torch.arange(ks.size(1))[None, :] > qpos[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ vh).transpose(1, 2).to(q.dtype), lse


def merge_in_float32(out_a, lse_a, out_b, lse_b):
    """Right to float32's precision, in the inputs' dtype, but never computed in float64."""
    a, b, la, lb = (x.float() for x in (out_a, out_b, lse_a, lse_b))
    out = a - torch.sigmoid(lb - la)[..., None] * (a - b)
    return out.to(out_a.dtype), (torch.maximum(la, lb) - F.logsigmoid((la - lb).abs())).to(lse_a.dtype)


def ring_waits_before_compute(q, k, v, causal=False, group=None):
    """Right numbers and messages, but each step waits for the next block before computing."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(p):
        src = (rank - step) % p
        incoming = kv
        if step < p - 1:
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, _peer(group, (rank + 1) % p), group),
                   dist.P2POp(dist.irecv, incoming, _peer(group, (rank - 1) % p), group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        if not causal or src <= rank:
            ob, lb = _block(q, kv[0], kv[1], causal and src == rank)
            out, lse = (ob, lb) if out is None else merge_partial_attention(out, lse, ob, lb)
        kv = incoming
    return out.transpose(1, 2).to(q.dtype), lse


def test_lab6_catches_bugs_on_the_property_that_shows_them(capsys):
    with pytest.raises(AssertionError, match="exp overflow"):
        lab6.check_merge_partial_attention(merge_without_max, hidden=True)
    lab6.check_merge_partial_attention(merge_without_max)        # fine on small scores
    assert "\u2713 merge_partial_attention: " in capsys.readouterr().out    # the ✓ line a passing cell prints
    with pytest.raises(AssertionError, match="float64.*differs"):            # fp64 held to fp64's precision
        lab6.check_merge_partial_attention(merge_in_float32, hidden=True)
    with pytest.raises(AssertionError, match="isend/irecv"):
        lab6.check_ring_attention_forward(ring_via_all_gather)
    with pytest.raises(Exception, match="blocking=True"):     # gloo's isend does not block, NCCL's may: visible
        run(dataclasses.replace(lab6.FUNCTIONS["ring_attention_forward"], timeout=6), ring_everyone_sends_first,
            hidden=False)


def test_lab6_measures_the_rings_overlap_with_a_late_peer():
    with pytest.raises(AssertionError, match="late=True.*pass must travel while you compute"):
        lab6.check_ring_attention_forward(ring_waits_before_compute, hidden=True)


# ------------------------------------------------------------------ library answers
def ulysses_from_library(q, k, v, causal=False, group=None):
    from minidist.context_parallel import ulysses_attention
    return ulysses_attention(q, k, v, causal, group)


def ring_from_library(q, k, v, causal=False, group=None):
    from minidist.context_parallel import ring_attention
    return ring_attention(q, k, v, causal, group, return_lse=True)


def ulysses_on_the_notebooks_all_to_all(q, k, v, causal=False, group=None):
    p = dist.get_world_size(group)
    if q.size(2) % p or k.size(2) % p:
        raise ValueError("heads do not split")
    qh, kh, vh = (all_to_all(x, 2, 1, group).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    return all_to_all(out.transpose(1, 2), 1, 2, group)


def test_lab6_refuses_the_library_but_stands_it_in_for_other_functions():
    for name, fn, what in (("ulysses_attention", ulysses_from_library, "ulysses"),
                           ("ring_attention_forward", ring_from_library, "ring"),
                           ("merge_partial_attention", lambda *a: __import__("minidist.context_parallel").context_parallel
                            .merge_partial_attention(*a), "merge")):
        with pytest.raises(AssertionError, match="called minidist's own implementation") as info:
            getattr(lab6, f"check_{name}")(fn)
        assert what in str(info.value), str(info.value)
    # Ulysses on an unfinished all_to_all passes: minidist's all-to-all stands in inside the ranks
    lab6.check_ulysses_attention(ulysses_on_the_notebooks_all_to_all)
