"""``minidist plan``: the layout planner (:mod:`minidist.cost.planner`) for a person at a terminal.

It says every assumption before the table, one unit per column, and wraps its prose at
the terminal's width. Bad input is an argparse error (exit 2), never a traceback.
"""
from __future__ import annotations

import json

from minidist.cli.output import format_table, plain, wrap
from minidist.presets import PRESETS, describe
from minidist.cost.checkpoint import BYTES_PER_PARAM
from minidist.units import count_arg, fraction_arg, memory_arg, positive_float_arg, positive_int_arg

MODEL_FIELDS = ("params", "layers", "hidden", "heads", "seq")
MOE_FIELDS = ("experts", "top_k", "ffn")                # optional: a dense GPT without them

DESCRIPTION = """\
Rank every (DP, PP, TP, CP, micro-batch) layout of a GPT on a cluster by modelled step time:
compute, the 1F1B bubble, alpha-beta traffic per axis (NVLink inside a node, InfiniBand across),
and memory per GPU. A model, not a measurement. With --experts (a Mixture of Experts), expert
parallelism (EP, carved out of DP, inside or across nodes) is a fifth axis.

Model presets (--model; any of --params/--layers/--hidden/--heads/--seq overrides its value):
""" + "\n".join(wrap(f"  {describe(name)}", hanging="      ") for name in PRESETS) + """

Sizes: memory takes a unit (80GB = 80e9 bytes, 80GiB = 80 * 2^30); parameter counts take K, M,
B (billion) or T, or an exponent (70B = 7e10 = 70e9)."""

EPILOG = """\
examples:
  minidist plan --model llama-70b --gpus 64
  minidist plan --model llama-7b --gpus 16 --overlap dp,tp
  minidist plan --model llama-7b --seq 8192 --gpus 16 --gpu-memory 40GB --zero 3
  minidist plan --params 7e9 --layers 32 --hidden 4096 --heads 32 --seq 4096 --gpus 64 --json
  minidist plan --model mixtral-8x7b --seq 4096 --gpus 64
  minidist plan --model llama-70b --gpus 64 --mtbf 3.1 --storage-bw 50
  minidist plan --params 20B --layers 24 --hidden 2048 --heads 16 --seq 4096 \\
      --experts 64 --top-k 2 --gpus 64"""


def add_arguments(p) -> None:
    model = p.add_argument_group("model (a preset, or all five numbers)")
    model.add_argument("--model", choices=sorted(PRESETS), help="a published architecture (listed above)")
    model.add_argument("--params", type=count_arg, metavar="COUNT", help="parameters in all, e.g. 7B or 7e9")
    model.add_argument("--layers", type=positive_int_arg, metavar="N", help="transformer layers")
    model.add_argument("--hidden", type=positive_int_arg, metavar="N", help="hidden size h")
    model.add_argument("--heads", type=positive_int_arg, metavar="N", help="attention heads")
    model.add_argument("--seq", type=positive_int_arg, metavar="N", help="sequence length (tokens)")
    model.add_argument("--experts", type=positive_int_arg, metavar="N",
                       help="experts per layer: a Mixture of Experts, each expert an MLP (default 1: dense)")
    model.add_argument("--top-k", type=positive_int_arg, metavar="K", help="experts each token uses (default 1)")
    model.add_argument("--ffn", type=positive_int_arg, metavar="N",
                       help="width of each expert's MLP (default 4 x hidden)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=positive_int_arg, metavar="N", required=True, help="GPUs in all")
    cluster.add_argument("--gpus-per-node", type=positive_int_arg, default=8, metavar="N", help="GPUs per node (NVLink inside)")
    cluster.add_argument("--gpu-memory", type=memory_arg, metavar="SIZE", default="80GB", help="per GPU, with a unit: 80GB, 80GiB")
    cluster.add_argument("--peak-tflops", type=float, metavar="X", default=989.0,
                         help="dense bf16 peak per GPU (H100 SXM data sheet)")
    cluster.add_argument("--mfu", type=fraction_arg, metavar="SHARE", default="50%",
                         help="share of peak the matmuls sustain (0.5 or 50%%)")
    training = p.add_argument_group("training")
    training.add_argument("--global-batch", type=positive_int_arg, metavar="N", default=512, help="sequences per step")
    training.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage over DP x CP")
    training.add_argument("--recompute", default="selective", choices=["none", "selective", "full"],
                          help="activation recomputation")
    training.add_argument("--overlap", default="dp", choices=["none", "dp", "dp,tp"],
                          help="communication counted as hidden behind compute: dp (DDP's bucketed all-reduce "
                               "behind the last backward), tp (asynchronous TP's collectives behind their matmuls)")
    training.add_argument("--headroom", type=fraction_arg, metavar="SHARE", default="10%",
                          help="memory to leave free per GPU; layouts that do rank first")
    ck = p.add_argument_group("checkpoints (give both: adds size, save time, Young's interval and goodput)")
    ck.add_argument("--mtbf", type=positive_float_arg, metavar="HOURS",
                    help="mean time between failures of the whole job, in hours (Llama 3: about 3.1)")
    ck.add_argument("--storage-bw", type=positive_float_arg, metavar="GB/s",
                    help="write bandwidth of the checkpoint storage, all writers together, in GB/s")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=positive_int_arg, metavar="N", default=15, help="rows of the table (--json lists every layout)")
    out.add_argument("--json", action="store_true", help="every layout, the excluded ones with their reason")


def model_numbers(args, error) -> dict:
    """The five model numbers: the preset's, overridden by any given flag; ``error`` if one is missing."""
    preset = PRESETS[args.model] if args.model else None
    numbers = {f: getattr(args, f) if getattr(args, f) is not None else getattr(preset, f, None) for f in MODEL_FIELDS}
    missing = [f"--{f}" for f, v in numbers.items() if v is None]
    if missing:
        error(f"give --model NAME ({', '.join(sorted(PRESETS))}) or all of {', '.join(missing)}")
    if numbers["hidden"] % numbers["heads"]:
        error(f"--hidden {numbers['hidden']} is not a multiple of --heads {numbers['heads']}")
    for f, default in zip(MOE_FIELDS, (1, 1, None)):
        given = getattr(args, f)
        numbers[f] = given if given is not None else getattr(preset, f, default)
    numbers["mlp_matrices"] = preset.mlp_matrices if preset else 2
    if numbers["top_k"] > numbers["experts"]:
        error(f"--top-k {numbers['top_k']} is more than the {numbers['experts']} experts per layer")
    return numbers


def assumptions(args, numbers: dict, cluster) -> str:
    """Every number the ranking rests on, in words."""
    source = f"{args.model} preset" if args.model else "given"
    overridden = [f"--{f.replace('_', '-')}" for f in MODEL_FIELDS + MOE_FIELDS
                  if args.model and getattr(args, f) is not None]
    recompute = {"none": "none (every activation kept)", "selective": "selective (attention scores recomputed)",
                 "full": "full (only each layer's input kept)"}[args.recompute]
    link = lambda l: f"{l.name}: {l.bandwidth / 1e9:g} GB/s, alpha {l.alpha * 1e6:g} us"     # noqa: E731
    moe = ""
    if numbers["experts"] > 1:
        mlp = "SwiGLU" if numbers["mlp_matrices"] == 3 else "GELU"
        moe = (f" Mixture of Experts: {numbers['experts']} experts per layer, top-{numbers['top_k']}, each a {mlp} "
               f"MLP of width {numbers['ffn'] or 4 * numbers['hidden']}; EP carved out of DP.")
    return "\n".join([
        f"Model ({source}{'; ' + ', '.join(overridden) + ' given' if overridden else ''}): "
        f"{numbers['params'] / 1e9:.3g}B parameters, {numbers['layers']} layers, hidden {numbers['hidden']}, "
        f"{numbers['heads']} heads, sequence {numbers['seq']} tokens.{moe}",
        f"Cluster: {args.gpus} GPUs, {args.gpus_per_node} per node, {args.gpu_memory / 1e9:.1f} GB each; "
        f"peak {args.peak_tflops:g} TFLOP/s per GPU at {args.mfu:.0%} MFU.",
        f"Links per GPU and direction: {link(cluster.intra)}; {link(cluster.inter)}.",
        f"Training: global batch {args.global_batch} sequences; bf16 activations, gradients and messages; "
        f"mixed-precision Adam with ZeRO-{args.zero} over DP x CP; recomputation {recompute}; "
        f"sequence parallelism with TP; 1F1B schedule; {_overlap_words(args.overlap)}",
        f"Headroom: layouts leaving at least {args.headroom:.0%} of GPU memory free rank first.",
    ] + ([f"Checkpoints: fp32 master weights and Adam's two moments plus the bf16 weights "
          f"({BYTES_PER_PARAM['adam-mixed']} bytes per parameter), written by DP x CP rank 0 without ZeRO and by "
          f"every rank with it; {args.storage_bw:g} GB/s shared by all writers; blocking saves every "
          f"sqrt(2 x save x MTBF) (Young 1974), MTBF {args.mtbf:g} h, restart time not counted."]
         if args.mtbf is not None else []))


def overlaps(choice: str) -> tuple[str, ...]:
    """--overlap's value as the planner's tuple: "none" -> (), "dp,tp" -> ("dp", "tp")."""
    return () if choice == "none" else tuple(choice.split(","))


def _overlap_words(choice: str) -> str:
    parts = {"dp": "DP's bucketed gradient all-reduce hides behind the last micro-batch's backward",
             "tp": "asynchronous TP hides TP's collectives behind (t-1)/t of their matmuls"}
    chosen = [parts[o] for o in overlaps(choice)]
    return ("overlap: " + "; ".join(chosen) + " (exposed = max(0, comm - overlappable compute)).") if chosen \
        else "no overlap of communication with compute."


def run(args, error) -> int:
    from minidist.cost.planner import Cluster, ModelSpec, explain, headroom_warning, plan_layouts
    numbers = model_numbers(args, error)
    if args.mfu <= 0 or args.peak_tflops <= 0:
        error("--mfu and --peak-tflops must be above 0")
    model = ModelSpec(**numbers)
    cluster = Cluster(args.gpus, args.gpus_per_node, args.gpu_memory, peak_flops=args.peak_tflops * 1e12,
                      mfu=args.mfu)
    try:
        plans = plan_layouts(model, cluster, global_batch=args.global_batch, zero_stage=args.zero,
                             recompute=args.recompute, headroom=args.headroom, overlap=overlaps(args.overlap))
    except ValueError as err:           # the model or cluster cannot be split at all
        error(str(err))
    if (args.mtbf is None) != (args.storage_bw is None):
        error("give both --mtbf and --storage-bw (or neither)")
    if args.mtbf is not None:
        for p in plans:
            p.checkpoint = checkpoint_numbers(p, numbers["params"], args)
    warning = headroom_warning(plans, cluster, args.headroom)
    if args.json:
        layouts = [p.as_dict() | ({"checkpoint": p.checkpoint} if args.mtbf is not None else {}) for p in plans]
        print(json.dumps({"assumptions": assumptions(args, numbers, cluster).splitlines(), "warning": warning,
                          "explanation": explain(plans, cluster), "layouts": layouts},
                         indent=2, default=str))
        return 0
    feasible = [p for p in plans if p.feasible]
    print(wrap(assumptions(args, numbers, cluster)))
    print()
    print(wrap(f"{len(feasible)} layouts fit on {args.gpus} GPUs; {len(plans) - len(feasible)} excluded "
               f"(--json gives each one's reason)."))
    if feasible:
        print(format_table(_rows(feasible[:args.top], args.mtbf is not None)))
        print("(b: sequences per micro-batch, m: micro-batches per step per DP rank"
              + ("; EP inside DP, (IB): its all-to-alls cross nodes)" if numbers["experts"] > 1 else ")"))
    print()
    if warning:
        print(wrap(warning))
    print(wrap(plain(explain(plans, cluster))))
    return 0 if feasible else 1


def checkpoint_numbers(plan, params: float, args) -> dict:
    """Bytes on the busiest rank, save seconds, Young's interval and the goodput it gives."""
    from minidist.cost.checkpoint import checkpoint_bytes_per_rank, goodput, save_seconds, young_interval
    per_rank = checkpoint_bytes_per_rank(int(params), plan.dp * plan.cp, plan.tp, plan.pp, args.zero, "adam-mixed")
    cost, mtbf = save_seconds(per_rank, args.storage_bw * 1e9), args.mtbf * 3600
    interval = young_interval(cost, mtbf)
    return {"max_rank_bytes": max(per_rank), "save_s": cost, "interval_s": interval,
            "goodput": goodput(interval, cost, mtbf)}


def _rows(plans, checkpoints: bool = False) -> list[dict]:
    """One unit per column, named in its header: ms or s (by the top layout's step), GB, %.
    b is the micro-batch size (sequences), m the micro-batches per step."""
    seconds = plans[0].time["total"] >= 1
    unit, scale = ("s", 1) if seconds else ("ms", 1e3)
    t = lambda x: f"{x * scale:.2f}" if seconds else f"{x * scale:.1f}"      # noqa: E731
    moe = "ep" in plans[0].time
    return [{"#": i + 1, "DP": p.dp, "PP": p.pp, "TP": p.tp, "CP": p.cp}
            | ({"EP": f"{p.ep}" + (" (IB)" if p.links.get("ep") == "InfiniBand" else "")} if moe else {})
            | {"b": p.micro_batch, "m": p.micro_batches, f"step ({unit})": t(p.time["total"]),
               f"compute ({unit})": t(p.time["compute"]), f"bubble ({unit})": t(p.time["bubble"]),
               f"comm ({unit})": t(sum(p.time.get(a, 0.0) for a in ("tp", "cp", "pp", "dp", "ep"))),
               f"hidden ({unit})": t(p.time.get("hidden", 0.0)),
               "memory (GB)": f"{p.memory['total'] / 1e9:.1f}", "free (%)": f"{p.free * 100:.0f}"}
            | ({"ckpt/rank (GB)": f"{p.checkpoint['max_rank_bytes'] / 1e9:.2f}", "save (s)": f"{p.checkpoint['save_s']:.1f}",
                "every (min)": f"{p.checkpoint['interval_s'] / 60:.1f}", "goodput (%)": f"{p.checkpoint['goodput'] * 100:.1f}"}
               if checkpoints else {})
            for i, p in enumerate(plans)]
