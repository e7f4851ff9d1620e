"""The layout planner: every (DP, PP, TP, CP, micro-batch) split of a cluster, ranked by modelled step time.

Narayanan et al. 2021 (Megatron-LM, PTD-P), Sec. 3's takeaways, turned into arithmetic
from the formulas of the other ``cost`` modules (nothing new is modelled here):

* memory per GPU (the first pipeline stage, which holds the most in-flight micro-batches
  under 1F1B): model states with mixed-precision Adam and ZeRO over the DP×CP ranks that
  hold the same weights (:func:`~minidist.cost.memory_techniques.mixed_precision_memory_bytes`,
  bf16), plus activations (:func:`~minidist.cost.memory_techniques.activation_bytes_paper` per
  layer on the s/CP tokens a rank holds; selective recomputation drops its 5as/h term, full
  recomputation keeps only each layer's input) × L/PP layers × the schedule's in-flight
  micro-batches (:func:`~minidist.cost.pipeline.pipeline_peak_activations`);
* time per step = compute (72·b·s·h²(1+s/6h) per layer, :func:`~minidist.cost.tensor_parallel.tp_layer_flops`,
  plus what recomputation runs again, :func:`~minidist.cost.memory_techniques.recompute_flops`,
  plus 6·b·s·h·V for the LM head, spread over all GPUs at ``mfu`` of peak) + the 1F1B bubble
  ((PP-1)/m of compute, :func:`~minidist.cost.pipeline.pipeline_bubble_ratio`) + α-β time of
  each axis's traffic: TP's collectives per layer and micro-batch
  (:func:`~minidist.cost.tensor_parallel.tp_comm_time`), CP's ring K/V passes
  (:func:`~minidist.cost.context_parallel.ring_attention_messages`), PP's activation and
  gradient per micro-batch, DP's ring all-reduce of the gradients once per step, minus what
  overlap hides (:mod:`~minidist.cost.overlap`, exposed = max(0, comm - overlappable compute)):
  with ``overlap`` naming "dp", DDP's bucketed all-reduce hides behind the last micro-batch's
  backward; naming "tp" (with sequence parallelism), asynchronous TP hides TP's collectives
  behind (t-1)/t of the linear layers' matmuls. ``time["hidden"]`` is the sum hidden.

Links: the mesh is (DP, PP, CP, TP), TP innermost. An axis runs over NVLink when it and
the axes inside it fit in one node, else over InfiniBand (a ring is as slow as its slowest
link). TP is kept inside a node: a layout whose TP group spans nodes is excluded.

Mixture of Experts (``experts`` > 1, :mod:`minidist.cost.expert_parallel`): each layer's
MLP is E experts of which a token uses k; EP ranks split the experts and is carved out of
DP (the innermost EP ranks of each DP group, stride PP·CP·TP), so an EP group is inside a
node when EP·PP·CP·TP fits one. Expert states are ZeRO-sharded over the DP·CP/EP ranks
that hold the same experts, dense ones over DP·CP; compute counts k experts' MLPs per
token; EP adds 4 all-to-alls per layer and micro-batch (dispatch and combine, forward and
backward, :func:`~minidist.cost.expert_parallel.ep_comm_time`) on its link; the gradient
all-reduce is the dense gradients' over DP·CP plus the experts' over DP·CP/EP.

Headroom: a layout that fills a GPU to the last byte rarely runs (the allocator's
fragmentation, NCCL's buffers and the CUDA context are not modelled), so with
``headroom=0.1`` the layouts that leave at least 10% of the memory free rank before the
ones that fit more tightly, each group by step time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from minidist.cost.collectives import allreduce_time, p2p_time
from minidist.cost.context_parallel import ring_attention_messages
from minidist.cost.expert_parallel import ep_comm_time, moe_activation_bytes, moe_layer_flops
from minidist.cost.memory_techniques import activation_bytes_paper, mixed_precision_memory_bytes, recompute_flops
from minidist.cost.overlap import OVERLAPS, dp_overlap_compute, exposed_time, tp_overlap_compute
from minidist.cost.pipeline import pipeline_bubble_ratio, pipeline_peak_activations
from minidist.cost.scale import PEAK_TFLOPS
from minidist.cost.tensor_parallel import (INFINIBAND_NDR, NVLINK_H100, Link,
                                           tp_comm_time, tp_layer_collectives, tp_layer_flops)

ELEM = 2                # bf16 activations, gradients and messages
PRECISION = "bf16"      # model states: 2 + 2 + 12 bytes per parameter (minidist.cost.memory_techniques)


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: ``params`` in all; the embedding and LM head (V·h each) are what the layers
    (12h² + 13h each) leave, which gives the vocabulary V. A Mixture of Experts has
    ``experts`` MLPs per layer (``ffn`` wide, default 4h, ``mlp_matrices`` h×ffn matrices:
    2 for GELU, 3 for SwiGLU) and a router (E·h), of which each token uses ``top_k``."""
    params: float
    layers: int
    hidden: int
    heads: int
    seq: int
    experts: int = 1
    top_k: int = 1
    ffn: int | None = None
    mlp_matrices: int = 2

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def mlp_params(self) -> float:
        """One MLP (one expert): its matrices and two biases."""
        f = 4 * self.hidden if self.ffn is None else self.ffn
        return self.mlp_matrices * self.hidden * f + f + self.hidden

    @property
    def dense_layer_params(self) -> float:
        """What every rank of a layer's TP group keeps whatever EP: attention (4h² + 4h), two
        LayerNorms (4h), the router (E·h) of a MoE; the MLP too when there is one expert."""
        h = self.hidden
        return 4 * h * h + 8 * h + (self.experts * h if self.moe else self.mlp_params)

    @property
    def layer_params(self) -> float:
        return self.dense_layer_params + (self.experts * self.mlp_params if self.moe else 0)

    @property
    def vocab(self) -> float:
        v = (self.params - self.layers * self.layer_params) / (2 * self.hidden)
        if v <= 0:
            raise ValueError(f"{self.layers} layers of hidden size {self.hidden} already hold "
                             f"{self.layers * self.layer_params:.3g} parameters, more than params={self.params:.3g}"
                             + (f" (with {self.experts} experts per layer: give the parameters of all of them)"
                                if self.moe else ""))
        return v


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu_memory: float                           # bytes
    peak_flops: float = PEAK_TFLOPS["H100"] * 1e12
    mfu: float = 0.5                            # share of peak the matmuls sustain
    intra: Link = NVLINK_H100
    inter: Link = INFINIBAND_NDR


@dataclass
class Plan:
    dp: int
    pp: int
    tp: int
    cp: int
    micro_batch: int
    micro_batches: int
    ep: int = 1                                     # expert parallelism, carved out of DP
    feasible: bool = True
    reason: str = ""
    memory: dict = field(default_factory=dict)      # bytes per GPU: params, grads, optimizer, activations, total
    time: dict = field(default_factory=dict)        # seconds per step: compute, bubble, tp, cp, pp, dp, hidden, total
    links: dict = field(default_factory=dict)       # axis -> "NVLink" / "InfiniBand"
    free: float = 0.0                               # share of the GPU's memory left free (feasible ones)

    @property
    def layout(self) -> str:
        return f"DP{self.dp} PP{self.pp} TP{self.tp} CP{self.cp}" + (f" EP{self.ep}" if self.ep > 1 else "")

    def as_dict(self) -> dict:
        return asdict(self) | {"layout": self.layout}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_links(dp: int, pp: int, cp: int, tp: int, gpus_per_node: int) -> dict[str, bool]:
    """axis -> True when its groups cross nodes (mesh order DP, PP, CP, TP; TP innermost)."""
    out, inner = {}, 1
    for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
        out[name] = size > 1 and inner * size > gpus_per_node
        inner *= size
    return out


def ep_crosses_nodes(ep: int, pp: int, cp: int, tp: int, gpus_per_node: int) -> bool:
    """EP is the innermost part of DP: its ranks are PP·CP·TP apart, so its group spans EP·PP·CP·TP ranks."""
    return ep > 1 and ep * pp * cp * tp > gpus_per_node


def stage_params(model: ModelSpec, pp: int, tp: int, ep: int = 1) -> float:
    """Parameters per GPU of the first stage: L/PP layers and the embedding (and, with PP = 1,
    the LM head too), split over TP; a MoE's experts also split over EP."""
    return sum(stage_param_split(model, pp, tp, ep))


def stage_param_split(model: ModelSpec, pp: int, tp: int, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters per GPU of the first stage; expert is 0 for a dense model."""
    ends = model.vocab * model.hidden * (2 if pp == 1 else 1)
    layers = model.layers // pp
    experts = layers * model.experts // ep * model.mlp_params / tp if model.moe else 0.0
    return (layers * model.dense_layer_params + ends) / tp, experts


def memory(model: ModelSpec, plan: Plan, *, zero_stage: int, recompute: str, sequence_parallel: bool,
           schedule: str = "1f1b") -> dict:
    """Bytes per GPU of the first pipeline stage (its layers, the embedding, the most micro-batches in flight)."""
    h, s = model.hidden, model.seq // plan.cp
    numel, expert_numel = stage_param_split(model, plan.pp, plan.tp, plan.ep)
    out = dict(mixed_precision_memory_bytes(PRECISION, zero_stage, numel, plan.dp * plan.cp))
    if expert_numel:            # expert states: sharded over the DP·CP/EP ranks holding the same experts
        experts = mixed_precision_memory_bytes(PRECISION, zero_stage, expert_numel, plan.dp * plan.cp // plan.ep)
        out = {k: out[k] + experts[k] for k in out}
    # none sbh(34 + 5as/h) [TP, SP forms]; selective drops 5as/h; full keeps each layer's input (its SP shard)
    per_layer = activation_bytes_paper(recompute, s, plan.micro_batch, h, model.heads, plan.tp, sequence_parallel)
    in_flight = pipeline_peak_activations(schedule, plan.pp, plan.micro_batches, rank=0)
    if model.moe and recompute != "full":     # k experts' MLP activations per token instead of one MLP's
        per_layer += moe_activation_bytes(s * plan.micro_batch, h, model.ffn or 4 * h, model.top_k, plan.tp,
                                          sequence_parallel, model.mlp_matrices)
    out["activations"] = per_layer * (model.layers // plan.pp) * in_flight
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"]
    return out


def step_time(model: ModelSpec, cluster: Cluster, plan: Plan, *, global_batch: int, recompute: str,
              sequence_parallel: bool, overlap: tuple[str, ...] = ("dp",)) -> tuple[dict, dict]:
    """Modelled seconds of one step by part, and each axis's link. Each axis's communication is
    its whole α-β time; ``hidden`` is what the ``overlap`` techniques hide of it, and
    ``total`` = compute + bubble + communication - hidden."""
    unknown = set(overlap) - set(OVERLAPS)
    if unknown:
        raise ValueError(f"overlap names {sorted(unknown)}; the planner knows {list(OVERLAPS)}")
    h, s, b, m = model.hidden, model.seq, plan.micro_batch, plan.micro_batches
    cross = axis_links(plan.dp, plan.pp, plan.cp, plan.tp, cluster.gpus_per_node)
    link = {a: cluster.inter if c else cluster.intra for a, c in cross.items()}
    moe = 0.0
    if model.moe:               # the dense 4h MLP (48·b·s·h²) replaced by the router and k experts
        moe = moe_layer_flops(global_batch * s, h, model.ffn or 4 * h, model.top_k, model.experts,
                              model.mlp_matrices) - 48 * global_batch * s * h * h
    # + what recomputation runs again: the whole forward (full; a third of forward + backward, the
    # experts' part included) or attention's 4bs²h (selective)
    layer_flops = (tp_layer_flops(global_batch, s, h) + moe + recompute_flops(recompute, global_batch, s, h)
                   + (moe / 3 if recompute == "full" else 0.0))
    flops = model.layers * layer_flops + 6 * global_batch * s * h * model.vocab
    compute = flops / (cluster.gpus * cluster.peak_flops * cluster.mfu)
    layers = model.layers // plan.pp
    s_local = s // plan.cp
    tp = tp_comm_time(tp_layer_collectives(b, s_local, h, plan.tp, sequence_parallel=sequence_parallel,
                                           elem_bytes=ELEM), plan.tp, link["tp"]) * layers * m
    cp_msgs = ring_attention_messages(b, s, model.heads // plan.tp, h // model.heads, plan.cp, elem_bytes=ELEM)
    cp = sum(p2p_time(c.nbytes, link["cp"].alpha, link["cp"].beta) for c in cp_msgs) * layers * m
    act = ELEM * b * s_local * h / (plan.tp if sequence_parallel else 1)
    pp = 2 * m * p2p_time(act, link["pp"].alpha, link["pp"].beta) if plan.pp > 1 else 0.0
    dense, experts = stage_param_split(model, plan.pp, plan.tp, plan.ep)
    n = plan.dp * plan.cp
    dp_link = link["dp"] if plan.dp > 1 else link["cp"]
    dp = allreduce_time("ring", n, ELEM * dense, dp_link.alpha, dp_link.beta) if n > 1 else 0.0
    if experts and n // plan.ep > 1:        # the experts' gradients over the ranks holding the same experts
        dp += allreduce_time("ring", n // plan.ep, ELEM * experts, dp_link.alpha, dp_link.beta)
    exposed = {"dp": dp, "tp": tp}
    if "dp" in overlap:
        exposed["dp"] = exposed_time(dp, dp_overlap_compute(compute, m))
    if "tp" in overlap and sequence_parallel:
        linear = model.layers * 72 * global_batch * s * h * h / (cluster.gpus * cluster.peak_flops * cluster.mfu)
        exposed["tp"] = exposed_time(tp, tp_overlap_compute(linear, plan.tp))
    out = {"compute": compute, "bubble": compute * pipeline_bubble_ratio(plan.pp, m), "tp": tp, "cp": cp,
           "pp": pp, "dp": dp}
    links = {a: ("InfiniBand" if c else "NVLink") for a, c in cross.items()}
    if model.moe:
        ep_cross = ep_crosses_nodes(plan.ep, plan.pp, plan.cp, plan.tp, cluster.gpus_per_node)
        tokens = b * s_local // (plan.tp if sequence_parallel else 1)
        out["ep"] = ep_comm_time(tokens, h, model.top_k, model.experts, plan.ep,
                                 cluster.inter if ep_cross else cluster.intra, elem_bytes=ELEM) * layers * m
        links["ep"] = "InfiniBand" if ep_cross else "NVLink"
    # summed from the exposed parts, so that a layout whose traffic is all hidden costs exactly its compute
    out["total"] = sum(v for k, v in out.items() if k not in exposed) + sum(exposed.values())
    out["hidden"] = (dp - exposed["dp"]) + (tp - exposed["tp"])
    return out, links


def plan_layouts(model: ModelSpec, cluster: Cluster, *, global_batch: int = 512, micro_batch_sizes=(1, 2, 4, 8),
                 zero_stage: int = 1, recompute: str = "selective", sequence_parallel: bool = True,
                 max_cp: int | None = None, headroom: float = 0.0, overlap: tuple[str, ...] = ("dp",)) -> list[Plan]:
    """Every (DP, PP, TP, CP, micro-batch size) with DP·PP·TP·CP = gpus: the feasible ones first
    (those leaving at least ``headroom`` of the memory free before the others), fastest first
    (ties broken by the layout, so the order is deterministic), then the excluded ones with
    their ``reason``. ``overlap``: the techniques whose hidden communication the step time
    counts (see the module docstring), ``()`` for none."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if cluster.gpus < 1 or cluster.gpus_per_node < 1 or cluster.gpus % min(cluster.gpus, cluster.gpus_per_node):
        raise ValueError(f"{cluster.gpus} GPUs do not fill nodes of {cluster.gpus_per_node}")
    model.vocab                                  # noqa: B018  (raises when params is too small)
    plans = []
    for tp in _divisors(cluster.gpus):
        for cp in _divisors(cluster.gpus // tp):
            if max_cp and cp > max_cp:
                continue
            for pp in _divisors(cluster.gpus // (tp * cp)):
                dp = cluster.gpus // (tp * cp * pp)
                for ep, b in [(ep, b) for ep in (_divisors(dp) if model.moe else [1]) for b in micro_batch_sizes]:
                    m = global_batch // (dp * b) if global_batch % (dp * b) == 0 else 0
                    plan = Plan(dp, pp, tp, cp, b, m, ep)
                    plan.reason = _excluded(model, cluster, plan, global_batch)
                    if not plan.reason:
                        plan.memory = memory(model, plan, zero_stage=zero_stage, recompute=recompute,
                                             sequence_parallel=sequence_parallel)
                        plan.time, plan.links = step_time(model, cluster, plan, global_batch=global_batch,
                                                          recompute=recompute, sequence_parallel=sequence_parallel,
                                                          overlap=overlap)
                        if plan.memory["total"] > cluster.gpu_memory:
                            plan.reason = (f"needs {plan.memory['total'] / 1e9:.1f} GB per GPU, more than "
                                           f"{cluster.gpu_memory / 1e9:.0f} GB")
                    plan.feasible = not plan.reason
                    if plan.feasible:
                        plan.free = 1 - plan.memory["total"] / cluster.gpu_memory
                    plans.append(plan)
    key = lambda p: (not p.feasible, p.free < headroom, p.time.get("total", 0.0),  # noqa: E731
                     p.tp, p.pp, p.cp, p.dp, p.ep, p.micro_batch)
    return sorted(plans, key=key)


def _excluded(model: ModelSpec, cluster: Cluster, plan: Plan, global_batch: int) -> str:
    """Why a layout cannot run at all ("" when it can)."""
    if model.heads % plan.tp:
        return f"heads ({model.heads}) not divisible by TP={plan.tp}: TP splits whole heads"
    if plan.tp > cluster.gpus_per_node or cluster.gpus_per_node % plan.tp:
        return f"TP={plan.tp} would span nodes of {cluster.gpus_per_node} GPUs (TP stays on NVLink)"
    if model.layers % plan.pp:
        return f"layers ({model.layers}) not divisible by PP={plan.pp}"
    if model.seq % (2 * plan.cp) and plan.cp > 1:
        return f"seq ({model.seq}) not divisible by 2·CP={2 * plan.cp} (zigzag causal shards)"
    if model.experts % plan.ep:
        return f"experts ({model.experts}) not divisible by EP={plan.ep}"
    if not plan.micro_batches:
        return f"global batch {global_batch} does not split into DP={plan.dp} × micro-batches of {plan.micro_batch}"
    return ""


def explain(plans: list[Plan], cluster: Cluster) -> str:
    """Why the top layout wins, in the lectures' terms, from its own numbers."""
    feasible = [p for p in plans if p.feasible]
    if not feasible:
        return "No layout fits: more GPUs, more pipeline stages or recomputation would be needed."
    top, t = feasible[0], feasible[0].time
    ms = lambda x: f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"      # noqa: E731
    lines = [f"Top: {top.layout}, micro-batch {top.micro_batch} × m={top.micro_batches}: "
             f"{ms(t['total'])} per step, {top.memory['total'] / 1e9:.1f} GB per GPU."]
    if top.tp > 1:
        lines.append(f"TP={top.tp} stays inside a node ({top.links['tp']}): its 4 collectives per layer and "
                     f"micro-batch cost {ms(t['tp'])} per step there; over InfiniBand they would cost "
                     f"~{cluster.intra.bandwidth / cluster.inter.bandwidth:.0f}× more.")
    else:
        lines.append("TP=1: the model states and activations fit without splitting layers, so no per-layer collectives.")
    if top.pp > 1:
        lines.append(f"PP={top.pp} with m={top.micro_batches} micro-batches: the 1F1B bubble is (p-1)/m = "
                     f"{(top.pp - 1) / top.micro_batches:.3f} of compute ({ms(t['bubble'])}); more micro-batches "
                     f"shrink it, only one activation crosses each stage boundary ({ms(t['pp'])}).")
    if top.dp * top.cp > 1:
        who = f"DP={top.dp}" if top.cp == 1 else f"DP×CP={top.dp}×{top.cp} (CP ranks hold the same weights)"
        over = top.links["dp"] if top.dp > 1 else top.links["cp"]      # as step_time prices it
        lines.append(f"{who}: one all-reduce of the gradients per step over {over} "
                     f"({ms(t['dp'])}); once per step, it is the collective that best tolerates a slow link.")
    if top.cp > 1:
        lines.append(f"CP={top.cp}: each rank holds s/{top.cp} tokens; the ring's K/V passes cost {ms(t['cp'])}.")
    if "ep" in t:
        lines.extend(_expert_lines(feasible, top, ms))
    if t.get("hidden", 0.0) > 0:
        lines.append(f"Overlap hides {ms(t['hidden'])} of its communication behind computation "
                     f"(exposed = max(0, comm - overlappable compute)).")
    lines.append(f"Compute {ms(t['compute'])} at {cluster.mfu:.0%} of peak is the floor every layout shares.")
    return "\n".join(lines)


def _ep_place(plan: Plan) -> str:
    if plan.ep == 1:
        return "EP=1 (every GPU holds all experts)"
    return "EP inside a node" if plan.links["ep"] == "NVLink" else "EP across nodes"


def _expert_lines(feasible: list[Plan], top: Plan, ms) -> list[str]:
    """A MoE model: where the top layout puts EP, what its all-to-alls cost, and the best of each other placement."""
    if top.ep > 1:
        where = "inside a node, over NVLink" if top.links["ep"] == "NVLink" else "across nodes, over InfiniBand"
        lines = [f"EP={top.ep} {where}: each GPU keeps 1/{top.ep} of the experts (their states are sharded over "
                 f"the DP×CP/EP ranks holding the same experts); tokens reach their experts' ranks by 4 all-to-alls "
                 f"per layer and micro-batch, {ms(top.time['ep'])} per step."]
    else:
        lines = ["EP=1: the experts fit on every DP rank, so no token leaves its GPU (no all-to-all); only "
                 "the memory of the experts' states grows with their number."]
    for place in ("EP=1 (every GPU holds all experts)", "EP inside a node", "EP across nodes"):
        if place == _ep_place(top):
            continue
        best = min((p for p in feasible if _ep_place(p) == place), key=lambda p: p.time["total"], default=None)
        if best is None:
            lines.append(f"{place}: no layout that fits uses it.")
        else:
            lines.append(f"{place}: the fastest, {best.layout} (micro-batch {best.micro_batch}), takes "
                         f"{ms(best.time['total'])} ({best.time['total'] / top.time['total'] - 1:+.1%}; "
                         f"all-to-alls {ms(best.time['ep'])}).")
    return lines


def headroom_warning(plans: list[Plan], cluster: Cluster, headroom: float) -> str:
    """A warning when even the top layout leaves less than ``headroom`` of the memory free ("" if not)."""
    feasible = [p for p in plans if p.feasible]
    if not feasible or feasible[0].free >= headroom:
        return ""
    top = feasible[0]
    return (f"Warning: no layout leaves {headroom:.0%} of GPU memory free; the top one uses "
            f"{top.memory['total'] / 1e9:.1f} of {cluster.gpu_memory / 1e9:.1f} GB ({top.free:.1%} free), "
            f"and the allocator, NCCL buffers and the CUDA context need some of that. More GPUs, "
            f"a higher ZeRO stage or more recomputation would leave room.")
