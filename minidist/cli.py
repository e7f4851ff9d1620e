"""The ``minidist`` command: doctor, tour, bench and plan."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import platform
import sys
import time

import minidist.benchmarks


def format_table(rows: list[dict]) -> str:
    """Rows of dicts as an aligned text table (numbers in a compact, readable form)."""
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, float):
            if v == 0 or math.isnan(v):
                return f"{v:g}"
            return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:.3f}".rstrip("0").rstrip(".")
        return str(v)

    table = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in table])


def _emit(rows, as_json):
    print(json.dumps(rows, indent=2, default=str) if as_json else format_table(rows))


# ------------------------------------------------------------------------------ doctor
class Skip(Exception):
    """A doctor check that cannot run on this machine; its message says why."""


GPU_SUITE_LEVELS = ((1, "kernels, TP and the pipeline in a group of one, memory meters, fork rules"),
                    (4, "the tour, the deadlock report, a measured bubble, teardown, memory given back"))


def _doctor_checks():
    import torch
    import torch.distributed as dist
    import minidist
    from minidist.runtime.device import visible_gpus

    def all_reduce_check():
        t = torch.full((8,), float(dist.get_rank() + 1), device=minidist.device())
        dist.all_reduce(t)
        return t, str(t.device)

    def launch_case(n, device, **kw):
        def check():
            if device == "cuda" and gpus < n:
                raise Skip(f"needs {n} GPU(s), {gpus} visible")
            out = minidist.launch(all_reduce_check, n, device=device, timeout=60, **kw)
            expected = n * (n + 1) / 2
            bad = [r for r, (t, _) in enumerate(out) if not torch.allclose(t, torch.full((8,), expected))]
            if bad:
                raise AssertionError(f"ranks {bad} got the wrong sum")
            return f"sum correct on {n} ranks ({', '.join(sorted({d for _, d in out}))})"
        return check

    def gpu_name():     # asked inside a rank: CUDA initialised here would make every later launch spawn
        return torch.cuda.get_device_name(minidist.device())

    def gpus_row():
        if not gpus:
            return "0 (CPU only: labs run on gloo)"
        [name] = minidist.launch(gpu_name, 1, device="cuda", timeout=60)
        return f"{gpus}: {name}"

    def nccl_row():
        if not dist.is_nccl_available():
            raise Skip("this torch is built without NCCL (a CPU build): CUDA ranks cannot run here")
        if not gpus:
            raise Skip("no GPU visible: CUDA ranks cannot run here")
        return f"available, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"

    def suite_row(n, what):
        def check():
            if gpus < n:
                raise Skip(f"make test-gpu skips this level here: needs {n} GPU(s), {gpus} visible ({what})")
            return f"runnable here: make test-gpu ({what})"
        return check

    gpus = visible_gpus()
    return [
        ("python", lambda: platform.python_version()),
        ("torch", lambda: f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"),
        ("gloo backend", lambda: _require(dist.is_gloo_available(), "gloo is available")),
        ("GPUs", gpus_row),
        ("nccl backend", nccl_row),
        ("launch 2 ranks (cpu, fork)", launch_case(2, "cpu")),
        ("launch 4 ranks (cpu, fork)", launch_case(4, "cpu")),
        ("launch 2 ranks (cpu, spawn)", launch_case(2, "cpu", start_method="spawn")),
        ("launch 1 rank (cuda)", launch_case(1, "cuda")),
        ("launch 2 ranks (cuda)", launch_case(2, "cuda")),
        ("launch 4 ranks (cuda)", launch_case(4, "cuda")),
    ] + [(f"GPU suite, {n} GPU{'s' if n > 1 else ''}", suite_row(n, what)) for n, what in GPU_SUITE_LEVELS]


def _require(ok, message):
    if not ok:
        raise RuntimeError("missing")
    return message


def doctor(as_json=False) -> int:
    """One row per check: PASS, FAIL, or SKIP with the reason it cannot run here. 1 if any FAIL."""
    rows = []
    for name, check in _doctor_checks():
        start = time.perf_counter()
        try:
            detail, status = check(), "PASS"
        except Skip as why:
            detail, status = str(why), "SKIP"
        except Exception as err:
            detail, status = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", "FAIL"
        rows.append({"check": name, "status": status, "ok": status != "FAIL", "detail": detail,
                     "time_s": time.perf_counter() - start})
    if as_json:
        _emit(rows, True)
    else:
        for row in rows:
            print(f"{row['status']}  {row['check']:<30} {row['detail']}")
    return 0 if all(r["ok"] for r in rows) else 1


# -------------------------------------------------------------------------------- plan
def _bytes(text: str) -> float:
    """"80GB", "80e9", "80 GiB" -> bytes."""
    units = {"tib": 2 ** 40, "gib": 2 ** 30, "mib": 2 ** 20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "b": 1}
    t = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if t.endswith(unit):
            return float(t[:-len(unit)]) * scale
    return float(t)


def _add_plan_arguments(p) -> None:
    p.add_argument("--params", type=float, required=True, help="parameters in all, e.g. 7e9")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", type=_bytes, default=80e9, help="per GPU, e.g. 80GB")
    p.add_argument("--global-batch", type=int, default=512, help="sequences per step")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage over DP (default 1)")
    p.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    p.add_argument("--mfu", type=float, default=0.5, help="share of peak FLOP/s the matmuls sustain")
    p.add_argument("--top", type=int, default=15, help="rows of the table (--json lists every layout)")
    p.add_argument("--json", action="store_true")


def plan(args) -> int:
    from minidist.cost.planner import Cluster, ModelSpec, explain, plan_layouts
    model = ModelSpec(args.params, args.layers, args.hidden, args.heads, args.seq)
    cluster = Cluster(args.gpus, args.gpus_per_node, args.gpu_memory, mfu=args.mfu)
    plans = plan_layouts(model, cluster, global_batch=args.global_batch, zero_stage=args.zero,
                         recompute=args.recompute)
    if args.json:
        print(json.dumps({"explanation": explain(plans, cluster), "layouts": [p.as_dict() for p in plans]},
                         indent=2, default=str))
        return 0
    rows = [{"rank": i + 1, "DP": p.dp, "PP": p.pp, "TP": p.tp, "CP": p.cp, "micro_batch": p.micro_batch,
             "m": p.micro_batches, "step_s": p.time["total"], "compute_s": p.time["compute"],
             "bubble_s": p.time["bubble"], "comm_s": sum(p.time[a] for a in ("tp", "cp", "pp", "dp")),
             "memory_GB": p.memory["total"] / 1e9} for i, p in enumerate(q for q in plans if q.feasible)]
    excluded = [p for p in plans if not p.feasible]
    print(f"{len(rows)} layouts fit on {args.gpus} GPUs ({args.gpus_per_node} per node, "
          f"{args.gpu_memory / 1e9:.0f} GB each); {len(excluded)} excluded (--json gives each one's reason).")
    print(format_table(rows[:args.top]))
    print()
    print(explain(plans, cluster))
    return 0 if rows else 1


# -------------------------------------------------------------------------------- main
def _benchmarks():
    return sorted(m.name for m in pkgutil.iter_modules(minidist.benchmarks.__path__) if not m.name.startswith("_"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="minidist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="check torch, backends, GPUs, that ranks launch and all-reduce on CPU "
                                      "and CUDA, and which GPU-suite levels this machine can run")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("tour", help="run every technique on 4 CPU ranks against a single-process reference")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", help="run only the techniques whose name contains this text")
    p = sub.add_parser("plan", help="rank every DP x PP x TP x CP layout of a model on a cluster by modelled step time")
    _add_plan_arguments(p)
    bench = sub.add_parser("bench", help="benchmarks; `minidist bench NAME --help` for each")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name in _benchmarks():
        module = importlib.import_module(f"minidist.benchmarks.{name}")
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--json", action="store_true")
        module.add_arguments(p)
        p.set_defaults(module=module)
    args = parser.parse_args(argv)

    if args.command == "doctor":
        return doctor(args.json)
    if args.command == "plan":
        return plan(args)
    if args.command == "tour":
        from minidist.tour import run_tour
        rows = run_tour(args.only)
        _emit(rows, args.json)
        return 0 if all(r["passed"] for r in rows) else 1
    rows = args.module.run(args)
    _emit(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
