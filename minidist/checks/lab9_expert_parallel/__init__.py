"""Lab 9's checks (expert parallelism: a Mixture-of-Experts layer whose experts live on different
ranks): each graded function against the same layer in one process, and its traced all-to-alls
against the cost model.

Shazeer et al. 2017 (sparsely-gated top-k MoE), Lepikhin et al. 2020 (GShard: capacity, dispatch and
combine by all-to-all), Fedus et al. 2021 (Switch Transformers: the load-balancing loss
``E · Σ_i f_i · P_i``). A lab test cell is a one-liner::

    checks.check_function("ep_dispatch", ep_dispatch)
    checks.check_function("ep_dispatch", ep_dispatch, hidden=True)
    checks.check_device("ep_dispatch", ep_dispatch)     # no tensor made off the tokens' device

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

from minidist.checks.kit.check import Registry
from minidist.checks.kit.device_check import on_meta
from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT
from minidist.checks.kit.refused_code import Refusal
from minidist.checks.lab9_expert_parallel import answers, cases, stand_ins, verdicts
from minidist.checks.lab9_expert_parallel.cases import make_experts
from minidist.checks.lab9_expert_parallel.demo import measure
from minidist.checks.lab9_expert_parallel.route import Route

#: minidist's expert parallelism is refused in graded code; the lab hands out no helper from it.
REFUSED = Refusal("expert parallelism", ("minidist.expert_parallel",), checks=__name__)
CHECKS = Registry(__name__)


def refusal(name: str) -> Refusal:
    """What ``name``'s test refuses: minidist.expert_parallel, but the library code of the stand-ins it calls."""
    return Refusal(REFUSED.technique, REFUSED.modules, REFUSED.allow + stand_ins.allowed(name), REFUSED.checks)


_HERE = {"top_k_router": (cases.router_cases, answers.router, verdicts.router, cases.router_covered),
         "load_balancing_loss": (cases.loss_cases, answers.loss, verdicts.loss, cases.loss_covered)}
# the cases' expected values are computed here, before the launch: the library is refused in the ranks
_ON_RANKS = {"ep_dispatch": (cases.prepare(partial(cases.exchange_cases, "ep_dispatch"), cases.group_dispatch),
                             answers.dispatch, verdicts.dispatch),
             "ep_combine": (cases.prepare(partial(cases.exchange_cases, "ep_combine"), cases.group_dispatch),
                            answers.combine, verdicts.combine),
             "moe_layer": (cases.prepare(cases.moe_cases, verdicts.moe_expected), answers.layer, verdicts.layer)}
_CHECKS = {
    **{name: CHECKS.check(name, case_list, answer, verdict, refusal=refusal(name), covered=covered)
       for name, (case_list, answer, verdict, covered) in _HERE.items()},
    **{name: CHECKS.check(name, case_list, answer, verdict, where="groups", world=cases.WORLD, refusal=refusal(name),
                          stand_ins=partial(stand_ins.stand_ins, name), covered=partial(cases.on_ranks_covered, name))
       for name, (case_list, answer, verdict) in _ON_RANKS.items()}}
#: graded name -> its check, in the notebook's order
FUNCTIONS = {name: _CHECKS[name] for name in cases.GRADED}
#: the functions that make tensors of their own (counts, receive buffers, the combined output)
DEVICE = {name: on_meta(_CHECKS[name]) for name in ("ep_dispatch", "ep_combine")}

#: Route: what ep_dispatch returns for ep_combine (handed out); make_experts: the experts the checks use
__all__ = ["CHECKS", "REFUSED", "Route", "check_device", "check_function", "make_experts", "measure"]


@CHECKS.entry(FUNCTIONS, by="name")
def check_function(name: str, fn, hidden: bool = False, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Lab 9's graded function ``name``. The router and the loss in this process; the others on 4
    ranks cut into groups of t (visible t = 2, 4; hidden 1, 2, 4): outputs and every gradient equal
    one process, the caller's tensors unchanged, the traced all-to-alls equal the cost model.
    Hidden cases: k = 1, fp64, uneven and empty loads, dropped choices, capacity, bad input."""


@CHECKS.entry(DEVICE, by="name")
def check_device(name: str, fn, timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """Where the tensors of ``name`` (``ep_dispatch`` or ``ep_combine``) live: its first visible case,
    run with torch's default device ``meta`` in every rank (kit/device_check.py). A tensor made without
    ``device=`` fails, naming its line: on a GPU node it would sit on the CPU next to CUDA tensors."""
