"""minidist.checks.lab5_tensor_parallel: the kinds of mistakes issue 29 lists fail, each naming its
case and rank (a g that reduces into the caller's tensor, SP hooks that pile up over calls, an SP
buffer in the default dtype). Answers written with torch's functional collectives are graded by the
bank's alternatives (``selftest``): importing them here would load torch._dynamo into the test run."""
import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.checks import lab5_tensor_parallel as L5
from minidist.checks.lab5_tensor_parallel.verdicts import with_traffic
from minidist.tensor_parallel import comm as TPC


@pytest.fixture(autouse=True)
def _library_answers_allowed(monkeypatch):
    """The answers below call minidist's own f, g and SP collectives: the refusal is off here."""
    for name, (stub, check, by) in list(L5.CHECKS.entries.items()):
        if by is None:
            monkeypatch.setitem(L5.CHECKS.entries, name, (stub, dataclasses.replace(check, refusal=None), by))


class _InPlaceG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)          # into the caller's tensor
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def in_place_g(x, group=None):
    return _InPlaceG.apply(x, group)


def hooked_sp_block(x, ln, mlp, group=None):
    """Right on the first call; every call registers three more hooks on the parameters."""
    def summed(g):
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g
    for p in (ln.weight, ln.bias, mlp.proj.bias):
        p.register_hook(summed)
    t, r = dist.get_world_size(group), dist.get_rank(group)
    h = TPC.gather_along_dim(F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps), 1, group)
    h = F.gelu(F.linear(h, mlp.fc.weight.tensor_split(t)[r], mlp.fc.bias.tensor_split(t)[r]))
    y = TPC.reduce_scatter_along_dim(F.linear(h, mlp.proj.weight.tensor_split(t, dim=1)[r]), 1, group)
    return x + y + mlp.proj.bias


def default_dtype_sp_reduce_scatter(x, group=None):
    """Forward only matters here: the output buffer is float32 whatever x is."""
    t = dist.get_world_size(group)
    full = x.movedim(1, 0).contiguous()
    out = torch.empty((full.shape[0] // t, *full.shape[1:]), device=x.device)
    dist.reduce_scatter_tensor(out, full, group=group)
    return out.movedim(0, 1)


def test_g_into_the_callers_tensor_fails_naming_case_and_rank():
    with pytest.raises(AssertionError, match=r"reduce_from_tp \(t=2, shape=\(2, 12, 24\), dtype=float32\), rank 0 "
                                             r"\(rank 0 of its group\): the caller's x changed during the forward"):
        L5.check_reduce_from_tp(in_place_g)


def test_hooks_added_at_every_call_fail_on_the_second_call():
    with pytest.raises(AssertionError, match=r"sp_mlp_block \(t=2, default sizes\), rank 0 .*ln\.weight\.grad differs.*"
                                             r"\(second call on the same module\)"):
        L5.check_sp_mlp_block(hooked_sp_block)


def test_dtypes_are_exact_and_a_pass_prints_its_line(capsys):
    L5.check_sp_gather(lambda x, group=None: TPC.gather_along_dim(x, 1, group))
    assert "\u2713 sp_gather: t = 2, 4, fp32" in capsys.readouterr().out
    with pytest.raises(Exception, match=r"sp_reduce_scatter.*t=2: dtype=float64"):
        L5.check_sp_reduce_scatter(default_dtype_sp_reduce_scatter, hidden=True)


class _WorldG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y)                       # no group=: the sum over all 4 ranks
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_g_over_the_world_in_a_group_of_two_is_diagnosed_as_a_missing_group():
    with pytest.raises(AssertionError, match=r"reduce_from_tp \(t=2, .*\), rank 0 .*the output differs.*\. It equals "
                                             r"the sum over all 4 ranks \(the world\), not over the 2 ranks of its group"):
        L5.check_reduce_from_tp(lambda x, group=None: _WorldG.apply(x, group))


def test_a_traffic_problem_names_the_call_it_was_found_in():
    """A module called twice: a problem on the first call is reported as it is; one that only the
    second call has says so."""
    want = {"forward": Counter(), "backward": Counter({("all-reduce", 64): 1})}
    good = {"forward": [], "backward": [["all-reduce", 64]]}
    bad = {"forward": [["all-reduce", 64]], "backward": [["all-reduce", 64]]}
    assert with_traffic([None], 2, [good, good], want) is None
    first = with_traffic([None], 2, [bad, bad], want)
    assert first == "forward communicated 1 x all-reduce of 64 B; expected nothing"
    second = with_traffic([None], 2, [good, bad], want)
    assert second == first + " (second call on the same module)"
    assert with_traffic(["wrong output"], 2, [bad], want) == "wrong output"     # values first
    assert with_traffic([None], 1, [bad], want) is None                         # no traffic in a group of one
