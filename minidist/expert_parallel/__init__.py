"""Expert parallelism: a Mixture-of-Experts layer whose experts live on different ranks.

Shazeer et al. 2017 (sparsely-gated MoE, top-k gating); Lepikhin et al. 2021 (GShard:
capacity, dispatch/combine all-to-alls, expert parallelism); Fedus et al. 2022 (Switch
Transformers: capacity factor, load-balancing loss); Zoph et al. 2022 (ST-MoE: router
z-loss); Gale et al. 2023 (MegaBlocks: dropless). E experts over an EP group of e ranks,
E/e experts per rank; every token travels to the ranks of its k experts and back:

    y_t = Σ_{kept j} w_{t,j} · expert_{i_{t,j}}(x_t),  w = top-k of softmax(x Wᵣᵀ), renormalised

Read in this order, each file top to bottom:

* ``router``: :func:`top_k_router` → :class:`Routing` (indices, weights, mask, probs,
  capacity); capacity C = ceil(cf·T·k/E), GShard's priority order (:func:`within_capacity`);
  ``capacity_factor=None`` is dropless;
* ``losses``: :func:`load_balancing_loss` (E·Σ f_i P_i), :func:`router_z_loss`;
* ``exchange``: :func:`all_to_all_rows` (``AllToAllRows``), rows to the group's ranks in uneven
  splits, differentiable: backward is the same exchange with the splits swapped;
* ``dispatch``: :func:`ep_dispatch` / :func:`ep_combine`: counts exchanged first, then one
  uneven exchange of rows each way, regrouped by local expert (:class:`DispatchPlan`);
* ``simulate``: :func:`simulate_dispatch`, a whole group's dispatch in one process (every
  rank's plan, and the source and pair of every row received);
* ``reference``: :func:`moe_reference`, the plain single-process layer (the ground truth);
* ``layer``: :func:`moe_layer` (functional) and :class:`MoELayer` (a rank's share; returns y, aux loss);
* ``parallel``: the (dp, ep) mesh: :func:`ep_dp_groups`, :func:`new_ep_dp_groups`,
  :func:`sync_moe_gradients` (dense grads over all ranks, expert grads over the d replicas).

Usage inside a rank::

    ep_group, edp_group = new_ep_dp_groups(ep=2)                       # 4 ranks: DP 2 × EP 2
    layer = MoELayer(hidden=16, ffn=32, num_experts=4, k=2, capacity_factor=1.25, group=ep_group)
    y, aux = layer(x)                                                   # x: this rank's tokens (..., 16)
    (loss(y) + aux).backward(); sync_moe_gradients(layer, edp_group)   # then the optimizer step

Every function that communicates takes a ``group`` (None: the world); a group of one rank
sends nothing; tensors follow the inputs' device. Bad sizes are a ValueError before any
collective. Costs: :mod:`minidist.cost.expert_parallel`; the DP × EP training step:
:mod:`minidist.harness.expert_parallel`.
"""
from minidist.expert_parallel.dispatch import DispatchPlan, ep_combine, ep_dispatch, expert_owner
from minidist.expert_parallel.exchange import AllToAllRows, all_to_all_rows
from minidist.expert_parallel.layer import (ExpertMLP, MoELayer, local_expert_range, make_experts, make_router_weight,
                                            moe_layer, run_experts)
from minidist.expert_parallel.losses import load_balancing_loss, router_z_loss, tokens_per_expert
from minidist.expert_parallel.parallel import (dense_parameters, ep_dp_groups, expert_parameters, new_ep_dp_groups,
                                               sync_moe_gradients)
from minidist.expert_parallel.reference import moe_reference
from minidist.expert_parallel.router import Routing, check_moe_sizes, expert_capacity, top_k_router, within_capacity
from minidist.expert_parallel.simulate import SimulatedDispatch, simulate_dispatch

__all__ = ["Routing", "top_k_router", "expert_capacity", "check_moe_sizes", "within_capacity",
           "load_balancing_loss", "router_z_loss", "tokens_per_expert", "AllToAllRows", "all_to_all_rows",
           "DispatchPlan", "ep_dispatch", "ep_combine", "expert_owner", "SimulatedDispatch", "simulate_dispatch",
           "moe_reference", "ExpertMLP", "make_experts", "make_router_weight", "run_experts", "moe_layer", "MoELayer",
           "local_expert_range", "ep_dp_groups", "new_ep_dp_groups", "expert_parameters", "dense_parameters",
           "sync_moe_gradients"]
