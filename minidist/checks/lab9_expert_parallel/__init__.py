"""Lab 9's checks (expert parallelism: a Mixture-of-Experts layer whose experts live on different
ranks): each graded function against the same layer in one process, and its traced all-to-alls
against the cost model.

Shazeer et al. 2017 (sparsely-gated top-k MoE), Lepikhin et al. 2020 (GShard: capacity, dispatch and
combine by all-to-all), Fedus et al. 2021 (Switch Transformers: the load-balancing loss
``E · Σ_i f_i · P_i``). A lab test cell is a one-liner::

    checks.check_ep_dispatch(ep_dispatch)
    checks.check_ep_dispatch(ep_dispatch, hidden=True)
    checks.check_device(ep_dispatch)     # no tensor made off the tokens' device

``top_k_router`` and ``load_balancing_loss`` communicate nothing and are checked in this process.
The distributed ones run one launch of 4 ranks per call, cut into expert-parallel groups of t
consecutive ranks (visible t = 2, 4; hidden t = 1, 2, 4). A case compares, on every rank, the
outputs and every gradient (tokens, expert outputs, router weights, every local expert's
parameters) with one process within ``cases.TOL``, checks that the caller's tensors are unchanged,
and for t > 1 that the traced all-to-alls (kind, bytes) equal :mod:`minidist.cost.expert_parallel`:
the counts first, then the rows. Loads are uneven on purpose: group rank s holds ``5 + s`` tokens,
and hidden cases send every token to one rank, starve an expert, or drop every choice of a rank.
The expected values come from :mod:`minidist.expert_parallel` (its router and loss, its
one-process dispatch of a whole group, ``simulate_dispatch``, and ``moe_reference``), computed
before the ranks are launched (``cases.prepare``). Inside the ranks the notebook's functions a graded one calls are stood in for by thin
adapters over the library (``stand_ins.py``); ``minidist.expert_parallel`` is refused while graded
code runs, except, in each test, the library code of the stand-ins that test needs (never its own
function's). ``Route`` (``route.py``) is the type ``ep_dispatch`` returns. The cases are in
``cases.py``, the code that runs the student's functions in ``answers.py``, the comparisons in
``verdicts.py``, the demo cells' measurement in ``demo.py`` (docs/AUTHORING.md).
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab9_expert_parallel import answers, cases, verdicts
from minidist.checks.lab9_expert_parallel.cases import make_experts
from minidist.checks.lab9_expert_parallel.demo import measure
from minidist.checks.lab9_expert_parallel.route import Route
from minidist.checks.lab9_expert_parallel.stand_ins import STAND_INS

#: Route: what ep_dispatch returns for ep_combine (handed out); make_experts: the experts the checks use
__all__ = ["CHECKS", "REFUSED", "Route", "check_device", "check_ep_combine", "check_ep_dispatch",
           "check_load_balancing_loss", "check_moe_layer", "check_top_k_router", "make_experts", "measure"]

#: minidist's expert parallelism is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("expert parallelism", ("minidist.expert_parallel",), checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)

_HERE = {"top_k_router": (cases.router_cases, answers.router, verdicts.router, cases.router_covered),
         "load_balancing_loss": (cases.loss_cases, answers.loss, verdicts.loss, cases.loss_covered)}
# the cases' expected values are computed here, before the launch: the library is refused in the ranks
_ON_RANKS = {"ep_dispatch": (cases.prepare(partial(cases.exchange_cases, "ep_dispatch"), cases.group_dispatch),
                             answers.dispatch, verdicts.dispatch),
             "ep_combine": (cases.prepare(partial(cases.exchange_cases, "ep_combine"), cases.group_dispatch),
                            answers.combine, verdicts.combine),
             "moe_layer": (cases.prepare(cases.moe_cases, verdicts.moe_expected), answers.layer, verdicts.layer)}
_CHECKS = {
    **{name: CHECKS.check(name, case_list, answer, verdict, refusal=STAND_INS.refusal(REFUSED, name), covered=covered)
       for name, (case_list, answer, verdict, covered) in _HERE.items()},
    **{name: CHECKS.check(name, case_list, answer, verdict, where="groups", world=cases.WORLD,
                          refusal=STAND_INS.refusal(REFUSED, name), stand_ins=STAND_INS.rebound(name),
                          covered=partial(cases.on_ranks_covered, name))
       for name, (case_list, answer, verdict) in _ON_RANKS.items()}}
#: graded name -> its check, in the notebook's order
FUNCTIONS = {name: _CHECKS[name] for name in cases.GRADED}
#: the functions that make tensors of their own (counts, receive buffers, the combined output)
DEVICE = CHECKS.devices(FUNCTIONS["ep_dispatch"], FUNCTIONS["ep_combine"])


@CHECKS.entry(FUNCTIONS["top_k_router"])
def check_top_k_router(fn, *, hidden: bool = False) -> None:
    """The top-k router, in this process: expert indices, weights and the capacity's keep mask (every first
    choice queued before any second) and the logits' gradient equal the library's router's."""


@CHECKS.entry(FUNCTIONS["load_balancing_loss"])
def check_load_balancing_loss(fn, *, hidden: bool = False) -> None:
    """The Switch Transformers loss ``E · Σ_i f_i · P_i``, in this process, and its gradient."""


@CHECKS.entry(FUNCTIONS["ep_dispatch"])
def check_ep_dispatch(fn, *, hidden: bool = False) -> None:
    """The dispatch on 4 ranks cut into groups of t (visible t = 2, 4; hidden 1, 2, 4): the rows each
    expert's rank receives, the route and the tokens' gradient equal one process, the caller's tensors
    unchanged, the traced all-to-alls equal the cost model."""


@CHECKS.entry(FUNCTIONS["ep_combine"])
def check_ep_combine(fn, *, hidden: bool = False) -> None:
    """The combine on 4 ranks cut into groups of t: every token's weighted sum of its experts' outputs and
    both gradients equal one process, the caller's tensors unchanged, the traced all-to-alls equal the
    cost model."""


@CHECKS.entry(FUNCTIONS["moe_layer"])
def check_moe_layer(fn, *, hidden: bool = False) -> None:
    """The whole MoE layer on 4 ranks cut into groups of t: the output, the load-balancing loss and every
    gradient (tokens, router weights, each local expert's parameters) equal one process; hidden: k = 1,
    fp64, uneven and empty loads, dropped choices, capacity, bad input."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the tensors of ``ep_dispatch`` or ``ep_combine`` (found by its name) live: its first visible
    case, run with torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made
    without ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
