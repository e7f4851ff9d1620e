"""How long ``minidist --help`` and every ``minidist COMMAND --help`` take, and which import torch.

Each help is run as a person runs it: a fresh interpreter (``python -m minidist.cli ...
--help``), wall-clock from start to exit, median over ``--repeats`` runs; one more run
under ``python -X importtime`` says whether torch was imported. The target is under 1 s for
every help, which holds only where torch is not imported (importing torch alone takes
about 1-2 s on a 2-core machine, more under load).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per help (median)")


def commands() -> list[list[str]]:
    """Every help a person can ask for: the command's, each command's, each benchmark's."""
    names = sorted(f[:-3] for f in os.listdir(BENCHMARKS) if f.endswith(".py") and not f.startswith("_"))
    return ([[], ["doctor"], ["tour"], ["plan"], ["lab"], ["lab", "copy"], ["bench"]] +
            [["bench", name] for name in names])


def _run(argv: list[str], *flags: str) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *flags, "-m", "minidist.cli", *argv, "--help"], capture_output=True,
                         text=True, timeout=300)
    seconds = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"minidist {' '.join(argv)} --help exited {out.returncode}: {out.stderr.strip()[-300:]}")
    return seconds, out.stderr


def imports_torch(argv: list[str]) -> bool:
    _, log = _run(argv, "-X", "importtime")
    return any(line.rstrip().endswith("| torch") for line in log.splitlines())


def run(args) -> list[dict]:
    rows = []
    for argv in commands():
        times = [_run(argv)[0] for _ in range(max(1, args.repeats))]
        rows.append({"help": " ".join(["minidist", *argv, "--help"]), "median_s": statistics.median(times),
                     "max_s": max(times), "imports_torch": imports_torch(argv),
                     "under_1_s": statistics.median(times) < 1.0})
    return rows
