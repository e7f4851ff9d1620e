"""Lab 9's checks refuse minidist's own expert parallelism, stand the lab's reference in for the
notebook's other functions, and reject a bug on the property that shows it. (The bug bank and the
correct alternatives are in autograder/bugbank/lab9_expert_parallel.py, run by the selftest.) The
placeholders below stand for the notebook's other functions, which the checks replace inside the
ranks."""
import pytest
import torch

from minidist.checks import lab9_expert_parallel as lab9

REFUSED = "called minidist's own implementation"


def top_k_router(logits, k, capacity_factor=None):          # stood in by the lab's reference
    raise NotImplementedError


def load_balancing_loss(router_probs, expert_indices, num_experts):
    raise NotImplementedError


def ep_dispatch(tokens, expert_indices, num_experts, group=None):
    raise NotImplementedError


def ep_combine(expert_outputs, weights, route, group=None):
    raise NotImplementedError


def moe_on_the_notebooks_functions(x, router_weight, experts, k, group=None, capacity_factor=None):
    import torch.distributed as dist
    e = dist.get_world_size(group)
    if router_weight.size(0) != x.size(1) or router_weight.size(1) % e or len(experts) != router_weight.size(1) // e:
        raise ValueError("sizes")
    logits = x @ router_weight
    idx, w, keep = top_k_router(logits, k, capacity_factor)
    rows, route = ep_dispatch(x, idx.masked_fill(~keep, -1), router_weight.size(1), group)
    outs = [ex(c) for ex, c in zip(experts, rows.split(route.recv_counts.sum(0).tolist()))]
    return ep_combine(torch.cat(outs), w, route, group), load_balancing_loss(logits.softmax(-1), idx, logits.size(1))


def router_from_library(logits, k, capacity_factor=None):
    from minidist.expert_parallel import top_k_router as library
    r = library(logits, k, capacity_factor)
    return r.indices, r.weights, r.mask


def moe_from_library(x, router_weight, experts, k, group=None, capacity_factor=None):
    from minidist.expert_parallel import moe_layer
    return moe_layer(x, router_weight.t(), experts, k, capacity_factor, group=group)


def router_without_renormalising(logits, k, capacity_factor=None):
    top, idx = logits.softmax(-1).topk(k)
    return idx, top, torch.ones_like(idx, dtype=torch.bool)


def test_lab9_refuses_the_library_and_stands_in_the_reference():
    with pytest.raises(AssertionError, match=REFUSED) as info:
        lab9.check_function("top_k_router", router_from_library)
    assert "minidist.expert_parallel" in str(info.value)
    with pytest.raises(AssertionError, match=REFUSED):
        lab9.check_function("moe_layer", moe_from_library)
    with pytest.raises(AssertionError, match="weights differs from the reference"):
        lab9.check_function("top_k_router", router_without_renormalising)
    # a layer written on the notebook's unfinished functions passes: the reference stands in inside the ranks
    lab9.check_function("moe_layer", moe_on_the_notebooks_functions)


def router_with_an_integer_keep(logits, k, capacity_factor=None):
    top, idx = logits.softmax(-1).topk(k)
    return idx, top / top.sum(-1, keepdim=True), torch.ones_like(idx)


def router_scribbling_on_the_callers_logits(logits, k, capacity_factor=None):
    top, idx = logits.softmax(-1).topk(k)
    logits.data[0, 0] += 1.0            # after use: the results are right, the caller's tensor is not
    return idx, top / top.sum(-1, keepdim=True), torch.ones_like(idx, dtype=torch.bool)


def test_lab9_compares_with_the_kits_one_comparison():
    with pytest.raises(AssertionError, match="keep is int64, expected bool"):
        lab9.check_function("top_k_router", router_with_an_integer_keep)
    with pytest.raises(AssertionError, match="the caller's logits changed during the call"):
        lab9.check_function("top_k_router", router_scribbling_on_the_callers_logits)
