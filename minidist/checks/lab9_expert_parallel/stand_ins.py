"""Lab 9's stand-ins: the notebook's functions that a test does not grade, as thin adapters over
:mod:`minidist.expert_parallel`, rebound inside the ranks (a wrong ``ep_dispatch`` costs its own test,
not ``moe_layer``'s).

The library is refused while graded code runs; a test allows the library code of the stand-ins its
graded function calls (:data:`CALLS`), never the graded function's own: an adapter given (or pasted)
as the answer for the function it stands in for calls refused code and earns nothing. The lab's
contract and the library's differ in form only: the router returns a tuple (the library: a
``Routing``), a dropped choice is −1 (the library: a mask), ``ep_dispatch`` returns a
:class:`~.route.Route` (the library: a ``DispatchPlan``, the same tensors). The exchange of rows
(``all_to_all_rows``, ``AllToAllRows``) is the library's as it is.
"""
from __future__ import annotations

from minidist.checks.kit.stand_ins import StandIns
from minidist.checks.lab9_expert_parallel.route import route_of
from minidist.expert_parallel import dispatch, losses, router
from minidist.expert_parallel.exchange import AllToAllRows, all_to_all_rows

EP = "minidist.expert_parallel."


def top_k_router(logits, k, capacity_factor=None):
    routing = router.top_k_router(logits, k, capacity_factor)
    return routing.indices, routing.weights, routing.mask


def load_balancing_loss(router_probs, expert_indices, num_experts):
    return losses.load_balancing_loss(router_probs, expert_indices, num_experts)


def ep_dispatch(tokens, expert_indices, num_experts, group=None):
    rows, plan = dispatch.ep_dispatch(tokens, expert_indices.clamp(min=0), num_experts, expert_indices >= 0, group)
    return rows, route_of(plan)


def ep_combine(expert_outputs, weights, route, group=None):
    plan = dispatch.DispatchPlan(route.order, weights.shape[1], route.send_counts, route.recv_counts, weights.shape[0])
    return dispatch.ep_combine(expert_outputs, weights, plan, group)


#: graded function -> the notebook's functions it calls, stood in by the above (dispatch's cell holds the exchange)
CALLS = {"top_k_router": (), "load_balancing_loss": (), "ep_dispatch": (),
         "ep_combine": ("all_to_all_rows", "AllToAllRows"),
         "moe_layer": ("top_k_router", "load_balancing_loss", "ep_dispatch", "ep_combine")}
#: the notebook's name -> (stand-in, the library code it runs forward and backward, under minidist.expert_parallel)
STAND_INS = StandIns({
    "top_k_router": (top_k_router, ("router.top_k_router",)),
    "load_balancing_loss": (load_balancing_loss, ("losses.load_balancing_loss",)),
    "ep_dispatch": (ep_dispatch, ("dispatch.ep_dispatch", "exchange.AllToAllRows")),
    "all_to_all_rows": (all_to_all_rows, ("exchange.all_to_all_rows", "exchange.AllToAllRows")),
    "AllToAllRows": (AllToAllRows, ("exchange.AllToAllRows",)),
    "ep_combine": (ep_combine, ("dispatch.DispatchPlan", "dispatch.ep_combine", "exchange.AllToAllRows")),
}, calls=CALLS, prefix=EP)
