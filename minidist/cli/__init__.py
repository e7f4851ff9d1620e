"""The ``minidist`` command: doctor, tour, plan, bench and lab.

Building the parser imports no torch (``minidist --help`` and every ``--help`` answer at
once): each command's module imports what it needs when it runs, a benchmark's module is
imported only when that benchmark is named, and the benchmarks' one-line summaries are read
from their files. Every bad input ends as an argparse error (usage, one line, exit 2).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys

from minidist.cli import doctor, lab, plan, tour
from minidist.cli.output import HelpFormatter, emit, plain

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

DESCRIPTION = """\
Distributed training rebuilt from send/recv: check this machine, tour every technique,
plan a cluster layout, run a benchmark, copy a lab.

minidist COMMAND --help describes each command."""

EPILOG = """\
examples:
  minidist doctor
  minidist tour --only ring
  minidist plan --model llama-70b --gpus 64
  minidist bench collectives --sizes 1K,1M,16MiB
  minidist lab copy 1 ~/minidist-work"""

DOCTOR_EPILOG = """\
examples:
  minidist doctor
  minidist doctor --json"""


def benchmarks() -> dict[str, str]:
    """Benchmark name -> its docstring, read from minidist/benchmarks/*.py without importing it."""
    out = {}
    for name in sorted(os.listdir(BENCHMARKS)):
        if name.endswith(".py") and not name.startswith("_"):
            with open(os.path.join(BENCHMARKS, name), encoding="utf-8") as f:
                out[name[:-3]] = plain(ast.get_docstring(ast.parse(f.read())) or "")
    return out


def _named_benchmark(argv: list[str], names) -> str | None:
    """The benchmark ``argv`` asks for (the word after ``bench``), if it is one."""
    if "bench" in argv:
        rest = [a for a in argv[argv.index("bench") + 1:] if not a.startswith("-")]
        if rest and rest[0] in names:
            return rest[0]
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minidist", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, module, summary, description, epilog):
        p = sub.add_parser(name, help=summary, description=description, epilog=epilog, formatter_class=HelpFormatter)
        p.set_defaults(handler=module, error=p.error)     # errors are reported with the command's usage
        module.add_arguments(p)
        return p

    command("doctor", doctor, "check torch, backends, GPUs, rank launches, Jupyter and the labs' kernel",
            plain(doctor.__doc__), DOCTOR_EPILOG)
    command("tour", tour, "run every technique on CPU ranks against a single-process reference",
            tour.DESCRIPTION, tour.EPILOG)
    command("plan", plan, "rank every DP x PP x TP x CP layout of a model on a cluster by modelled step time",
            plan.DESCRIPTION, plan.EPILOG)
    command("lab", lab, "copy a lab out of the repository to work in", lab.DESCRIPTION, lab.EPILOG)

    found = benchmarks()
    bench = sub.add_parser("bench", help="benchmarks (minidist bench NAME --help for each)",
                           description="Benchmarks: tables measured on this machine, next to torch's own "
                                       "where torch has one.",
                           epilog="examples:\n  minidist bench launch\n  minidist bench cli --json",
                           formatter_class=HelpFormatter)
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    wanted = _named_benchmark(argv, found)
    for name, doc in found.items():
        p = bench_sub.add_parser(name, help=doc.splitlines()[0] if doc else "", description=doc,
                                 epilog=f"example:\n  minidist bench {name}", formatter_class=HelpFormatter)
        p.add_argument("--json", action="store_true", help="the rows as JSON")
        p.set_defaults(error=p.error)
        if name == wanted:          # only the benchmark asked for is imported (its module imports torch)
            module = importlib.import_module(f"minidist.benchmarks.{name}")
            module.add_arguments(p)
            p.set_defaults(module=module)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command != "bench":
        return args.handler.run(args, args.error)
    try:
        rows = args.module.run(args)
    except ValueError as err:       # the benchmark refused a value its arguments let through
        args.error(str(err).splitlines()[0])
    emit(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
