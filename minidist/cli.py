"""The ``minidist`` command: doctor, tour and bench."""
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
def _doctor_checks():
    import torch
    import torch.distributed as dist
    import minidist

    def all_reduce_check():
        t = torch.full((8,), float(dist.get_rank() + 1), device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        return t.cpu()

    def launch_case(n, **kw):
        def check():
            out = minidist.launch(all_reduce_check, n, timeout=30, **kw)
            expected = n * (n + 1) / 2
            bad = [r for r, t in enumerate(out) if not torch.allclose(t, torch.full((8,), expected))]
            if bad:
                raise AssertionError(f"ranks {bad} got the wrong sum")
            return f"sum correct on {n} ranks"
        return check

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = [
        ("python", lambda: platform.python_version()),
        ("torch", lambda: f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"),
        ("gloo backend", lambda: _require(dist.is_gloo_available(), "gloo is available")),
        ("GPUs", lambda: f"{gpus}" + (f": {torch.cuda.get_device_name(0)}" if gpus else " (CPU only: labs run on gloo)")),
        ("nccl backend", lambda: (f"available, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
                                  if gpus and dist.is_nccl_available() else "not usable here (needs GPUs)")),
        ("launch 2 ranks (gloo, fork)", launch_case(2, backend="gloo")),
        ("launch 4 ranks (gloo, fork)", launch_case(4, backend="gloo")),
        ("launch 2 ranks (gloo, spawn)", launch_case(2, backend="gloo", start_method="spawn")),
    ]
    if gpus >= 2 and dist.is_nccl_available():
        checks.append(("launch 2 ranks (nccl)", launch_case(2, backend="nccl")))
    if gpus >= 4 and dist.is_nccl_available():
        checks.append(("launch 4 ranks (nccl)", launch_case(4, backend="nccl")))
    return checks


def _require(ok, message):
    if not ok:
        raise RuntimeError("missing")
    return message


def doctor(as_json=False) -> int:
    rows = []
    for name, check in _doctor_checks():
        start = time.perf_counter()
        try:
            detail, ok = check(), True
        except Exception as err:
            detail, ok = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", False
        rows.append({"check": name, "ok": ok, "detail": detail, "time_s": time.perf_counter() - start})
    if as_json:
        _emit(rows, True)
    else:
        for row in rows:
            print(f"{'PASS' if row['ok'] else 'FAIL'}  {row['check']:<30} {row['detail']}")
    return 0 if all(r["ok"] for r in rows) else 1


# -------------------------------------------------------------------------------- main
def _benchmarks():
    return sorted(m.name for m in pkgutil.iter_modules(minidist.benchmarks.__path__) if not m.name.startswith("_"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="minidist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="check torch, backends, GPUs, and that 2 and 4 ranks launch and all-reduce")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("tour", help="run every technique on 4 CPU ranks against a single-process reference")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", help="run only the techniques whose name contains this text")
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
