"""Pipeline bubble vs m per schedule (sleep-compute: theory, simulated, measured), and step time vs torch.distributed.pipelining.

Part "bubble": every compute action sleeps a fixed time (``--t-f``, ``--t-b``;
interleaved chunks take 1/v of it), so p ranks on two cores really run in parallel
and the measured bubble (idle share of rank-time, from the traced compute spans) can
be held to theory. Target: the median over ``--repeats`` within 3 percentage points
for p = 4, m in {1, 4, 8, 16}. What remains is per-message wake-up latency, which a
loaded machine inflates; longer ``--t-f``/``--t-b`` shrink its share.

Part "torch": real compute on the same block-stack model, same stages, same
micro-batches; median step time of minidist's executor against ScheduleGPipe and
Schedule1F1B from ``torch.distributed.pipelining`` (which run on CPU gloo).
"""
from __future__ import annotations

import statistics

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def add_arguments(parser):
    parser.add_argument("--p", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16], help="micro-batch counts")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES, metavar="NAME",
                        help=f"schedules to measure, from {', '.join(SCHEDULES)}")
    parser.add_argument("--v", type=int, default=2, help="chunks per rank for interleaved")
    parser.add_argument("--t-f", type=float, default=0.05, help="sleep seconds per stage forward")
    parser.add_argument("--t-b", type=float, default=0.1, help="sleep seconds per stage backward")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per case (median)")
    parser.add_argument("--latency", type=float, default=0.002,
                        help="seconds per message for the 'sim_latency' column (simulator with communication cost)")
    parser.add_argument("--skip", choices=["bubble", "torch"], default=None, help="leave one part out")
    parser.add_argument("--width", type=int, default=256, help="model width for the torch comparison")
    parser.add_argument("--batch", type=int, default=64, help="batch for the torch comparison")


def _cases(args):
    from minidist.pipeline import make       # torch, imported when the benchmark runs (not for --help)
    out = []
    for name in args.schedules:
        for m in args.m:
            v = args.v if name == "interleaved" else 1
            try:
                make(name, args.p, m, **({"v": v} if v > 1 else {}))
            except ValueError as err:
                out.append((name, m, v, str(err).split(";")[0]))
                continue
            out.append((name, m, v, None))
    return out


def _sleep_rank(cases, costs_by_v, repeats, width=8):
    import torch.distributed as dist

    from minidist.models import block_stack, regression_batch
    from minidist.pipeline import make, partition, rank_chunks, run_schedule
    from minidist.trace import trace
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = regression_batch(16 * 4, width)
    out = []
    for name, m, v in cases:
        chunks = rank_chunks(partition(block_stack(p * v, width), p * v), p, rank)
        sched = make(name, p, m, **({"v": v} if v > 1 else {}))
        run_schedule(sched, chunks, x, y)     # warm-up, unmeasured: validation, first autograd calls
        runs = []
        for _ in range(repeats):
            dist.barrier()
            with trace() as t:
                stats = run_schedule(sched, chunks, x, y, costs=costs_by_v[v])
            runs.append((t, stats.peak_activations))
        out.append(runs)
    return out


def _bubble_rows(args):
    import minidist
    from minidist.cost import pipeline_bubble, pipeline_peak_activations
    from minidist.pipeline import Costs, bubble_of, make, simulate, slots_from_trace
    from minidist.trace import merge
    cases = _cases(args)
    runnable = [(n, m, v) for n, m, v, why in cases if why is None]
    costs_by_v = {v: Costs(F=args.t_f / v, B=args.t_b / v) for v in {1, args.v}}
    results = minidist.launch(_sleep_rank, args.p, runnable, costs_by_v, args.repeats, timeout=600)
    rows, k = [], 0
    for name, m, v, why in cases:
        row = {"part": "bubble", "schedule": name if v == 1 else f"{name}(v={v})", "p": args.p, "m": m}
        if why is not None:
            rows.append(row | {"note": why})
            continue
        c = costs_by_v[v]
        try:
            theory = pipeline_bubble(name, args.p, m, v, t_f=c.F, t_b=c.B)
        except ValueError:
            theory = None           # ZB-H1's formula needs m >= p
        sched = make(name, args.p, m, **({"v": v} if v > 1 else {}))
        sim = simulate(sched, c)
        # The formulas assume free messages; here each costs a wake-up or two of a loaded
        # CPU. Simulating with that latency explains most of the measured excess.
        sim_lat = simulate(sched, Costs(F=c.F, B=c.B, comm=args.latency)).bubble
        measured = [bubble_of(slots_from_trace(merge(results[r][k][i][0] for r in range(args.p))), args.p)
                    for i in range(args.repeats)]
        peak = max(results[r][k][0][1] for r in range(args.p))
        meas = statistics.median(measured)
        ref = theory if theory is not None else sim.bubble
        # Interference from other processes only ever adds idle time, so the best of the
        # repeats is the closest look at the schedule itself; the target is judged on the median.
        rows.append(row | {"theory": theory, "simulated": sim.bubble, "sim_latency": sim_lat, "measured": meas, "measured_min": min(measured),
                           "err_pts": 100 * abs(meas - ref), "within_3pts": abs(meas - ref) <= 0.03,
                           "peak_act": peak, "peak_act_theory": pipeline_peak_activations(name, args.p, m, 0, v),
                           "note": "vs simulated (formula needs m >= p)" if theory is None else ""})
        k += 1
    return rows


def _torch_rank(p, m, width, batch, n_blocks, repeats):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import minidist
    from minidist.models import block_stack, regression_batch
    from minidist.pipeline import make, partition, run_schedule

    rank = dist.get_rank()
    stages = partition(block_stack(n_blocks, width), p)
    x, y = regression_batch(batch, width)
    stage = PipelineStage(stages[rank], rank, p, minidist.device())
    runners = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        sched = make(name, p, m)
        torch_sched = cls(stage, m, loss_fn=F.mse_loss)
        runners[f"minidist {name}"] = lambda s=sched: run_schedule(s, [stages[rank]], x, y)

        def torch_step(ts=torch_sched):
            if rank == 0:
                ts.step(x)
            elif rank == p - 1:
                ts.step(target=y)
            else:
                ts.step()
        runners[f"torch {name}"] = torch_step
    times = {k: [] for k in runners}
    for _ in range(repeats + 1):           # the first round warms up (and torch's shape inference)
        for key, fn in runners.items():
            stages[rank].zero_grad()
            dist.barrier()
            with minidist.timed() as t:
                fn()
                dist.barrier()
            times[key].append(t.seconds)
    return {k: v[1:] for k, v in times.items()}


def _torch_rows(args):
    import minidist
    m = 8 if 8 in args.m else max(args.m)
    try:
        results = minidist.launch(_torch_rank, args.p, args.p, m, args.width, args.batch, 2 * args.p,
                                  args.repeats, timeout=600)
    except Exception as err:   # report, don't hide the bubble rows
        return [{"part": "torch", "note": f"torch.distributed.pipelining failed: {str(err).splitlines()[0]}"}]
    rows = []
    for name in ("gpipe", "1f1b"):
        ours = statistics.median(results[0][f"minidist {name}"])
        theirs = statistics.median(results[0][f"torch {name}"])
        rows.append({"part": "torch", "schedule": name, "p": args.p, "m": m, "step_ms_minidist": 1e3 * ours,
                     "step_ms_torch": 1e3 * theirs, "torch/minidist": theirs / ours,
                     "note": f"real compute, width {args.width}, batch {args.batch}, {2 * args.p} blocks"})
    return rows


def run(args) -> list[dict]:
    rows = []
    if args.skip != "bubble":
        rows += _bubble_rows(args)
    if args.skip != "torch":
        rows += _torch_rows(args)
    return rows
