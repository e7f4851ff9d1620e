"""The `minidist` command as a person meets it: help without torch, one set of units, every
bad input an argparse error (exit 2, one line, no traceback), `lab copy` never overwriting."""
import argparse
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from minidist.cli import main
from minidist.units import UnitError, parse_bytes, parse_count, parse_fraction

LLAMA = ["plan", "--model", "llama-7b", "--gpus", "8"]

BAD = [   # argv, text the one-line message must contain
    ([], "required: COMMAND"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--gpus", "8"], "give --model NAME"),
    (["plan", "--model", "gpt5", "--gpus", "8"], "invalid choice: 'gpt5'"),
    (LLAMA + ["--gpu-memory", "80"], "'80' has no unit; write e.g. 80GB"),
    (LLAMA + ["--gpu-memory", "80 parsecs"], "cannot read size '80 parsecs'"),
    (["plan", "--model", "llama-7b", "--gpus", "0"], "'0' must be at least 1"),
    (["plan", "--model", "llama-7b", "--gpus", "12"], "12 GPUs do not fill nodes of 8"),
    (LLAMA + ["--params", "7Q"], "cannot read count '7Q'; write e.g. 70B"),
    (LLAMA + ["--params", "1M"], "more than params"),
    (LLAMA + ["--hidden", "4095"], "not a multiple of --heads"),
    (LLAMA + ["--mfu", "150%"], "not between 0 and 1"),
    (LLAMA + ["--mfu", "0"], "must be above 0"),
    (LLAMA + ["--headroom", "lots"], "cannot read 'lots'"),
    (LLAMA + ["--zero", "4"], "invalid choice: 4"),
    (["lab"], "required: copy"),
    (["lab", "copy", "99", "somewhere"], "there is no lab 99; the labs are 1-"),
    (["lab", "copy", "one", "somewhere"], "invalid int value: 'one'"),
    (["bench"], "required: NAME"),
    (["bench", "nosuch"], "invalid choice: 'nosuch'"),
    (["bench", "collectives", "--sizes", "3X"], "cannot read size '3X'"),
    (["bench", "collectives", "--algorithms", "ring,bogus"], "unknown algorithm bogus"),
    (["bench", "launch", "--world-size", "0"], "world_size must be an int >= 1"),
]


@pytest.mark.parametrize("argv, says", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_input_is_a_usage_error_of_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: minidist") and err[-1].startswith("minidist"), err
    assert [line for line in err if ": error: " in line] == [err[-1]] and says in err[-1], err


def test_no_traceback_reaches_stderr():
    out = subprocess.run([sys.executable, "-m", "minidist.cli", *LLAMA, "--gpu-memory", "80"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("minidist plan: error: argument --gpu-memory: '80' has no unit; "
                                                   "write e.g. 80GB (10^9 bytes) or 80GiB (2^30)")


def test_help_of_every_command_imports_no_torch_and_shows_defaults_and_an_example():
    # One fresh interpreter for all of them: this one has imported torch long ago.
    code = """if True:
        import contextlib, io, json, sys
        from minidist.cli import benchmarks, main
        out = {}
        for argv in [["--help"], ["doctor", "--help"], ["tour", "--help"], ["plan", "--help"], ["lab", "--help"],
                     ["lab", "copy", "--help"], ["bench", "--help"]] + [["bench", b, "--help"] for b in benchmarks()]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
                main(argv)
            out[" ".join(argv)] = buf.getvalue()
        print(json.dumps({"torch": "torch" in sys.modules, "help": out}))
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    import json
    result = json.loads(run.stdout)
    assert result["torch"] is False, "a --help imported torch"
    for argv, text in result["help"].items():
        assert text.startswith("usage: minidist") and "example" in text and "``" not in text, (argv, text)
        assert max(len(line) for line in text.splitlines()) <= 100, argv
    assert "(default: 80GB)" in result["help"]["plan --help"] and "(default: 10%)" in result["help"]["plan --help"]
    assert "llama-70b: 69B parameters, 80 layers" in result["help"]["plan --help"]
    assert "bench collectives --help" in result["help"] and "bench zero --help" in result["help"]


def test_the_collectives_benchmark_names_every_all_reduce_of_the_library():
    from minidist.benchmarks.collectives import ALGORITHMS
    from minidist.collectives import ALL_REDUCES
    assert ALGORITHMS == tuple(ALL_REDUCES)


def test_units_read_the_same_everywhere():
    assert parse_bytes("80GB") == 80 * 10 ** 9 and parse_bytes("80GiB") == 80 * 2 ** 30
    assert parse_bytes("512MiB") == 2 ** 29 and parse_bytes("64K") == 2 ** 16 and parse_bytes("100") == 100
    assert parse_bytes("1.5 TB") == 1.5e12
    assert parse_count("70B") == 70e9 and parse_count("1.3B") == 1.3e9 and parse_count("7e9") == 7e9
    assert parse_count("175b") == 175e9 and parse_count("350M") == 350e6
    assert parse_fraction("10%") == parse_fraction("0.1") == 0.1
    for bad in (lambda: parse_bytes("80", bare=False), lambda: parse_bytes("3X"), lambda: parse_count("-7B"),
                lambda: parse_count("7GB"), lambda: parse_fraction("200%")):
        with pytest.raises(UnitError):
            bad()


def test_lab_copy_copies_the_released_lab_and_never_overwrites(tmp_path, capsys):
    assert main(["lab", "copy", "1", str(tmp_path)]) == 0
    copied = tmp_path / "lab1_collectives" / "lab1_collectives.ipynb"
    assert copied.read_bytes() == open(os.path.join(ROOT, "labs", "lab1_collectives", "lab1_collectives.ipynb"),
                                       "rb").read()
    assert "jupyter lab" in capsys.readouterr().out
    copied.write_text("my work")
    with pytest.raises(SystemExit) as exit:
        main(["lab", "copy", "1", str(tmp_path)])
    assert exit.value.code == 2 and "refusing to overwrite" in capsys.readouterr().err
    assert copied.read_text() == "my work"
    # DEST is always the parent: a missing one is created, and the lab keeps its own name inside it
    capsys.readouterr()
    assert main(["lab", "copy", "2", str(tmp_path / "new" / "mine")]) == 0
    made = tmp_path / "new" / "mine" / "lab2_data_parallel"
    assert (made / "lab2_data_parallel.ipynb").exists()
    out = capsys.readouterr().out
    assert f"to {made}" in out and f"jupyter lab {made}/" in out      # absolute paths, to paste anywhere
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit):
        main(["lab", "copy", "3", str(tmp_path / "a_file")])
    assert "is not a folder" in capsys.readouterr().err


def test_lab_copy_help_lists_every_released_lab(capsys):
    from minidist.cli.lab import lab_folders, numbers_text
    numbers = sorted(lab_folders())
    assert numbers[:9] == list(range(1, 10))
    with pytest.raises(SystemExit):
        main(["lab", "copy", "--help"])
    assert f"the lab's number ({numbers_text(numbers)})" in " ".join(capsys.readouterr().out.split())


def test_bench_cli_times_every_help_the_parser_offers():
    from minidist.benchmarks.cli import commands
    from minidist.cli import benchmarks, build_parser
    parser = build_parser([])
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {tuple(c) for c in commands()} >= {(), *((name,) for name in top.choices), ("lab", "copy"),
                                              *(("bench", name) for name in benchmarks())}


def test_doctor_s_kernel_row_fails_on_a_missing_or_foreign_kernel_and_says_the_fix(monkeypatch):
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
    from minidist.cli import doctor
    assert doctor.kernel_row().startswith("installed, runs ")           # make install registered it

    def missing(self, name):
        raise NoSuchKernel(name)
    monkeypatch.setattr(KernelSpecManager, "get_kernel_spec", missing)
    with pytest.raises(RuntimeError, match="not installed; run: .* -m ipykernel install --sys-prefix --name minidist"):
        doctor.kernel_row()
    foreign = KernelSpec(argv=["/usr/bin/python3", "-m", "ipykernel_launcher"], display_name="Python (minidist)")
    monkeypatch.setattr(KernelSpecManager, "get_kernel_spec", lambda self, name: foreign)
    with pytest.raises(RuntimeError, match="it runs /usr/bin/python3, not this interpreter"):
        doctor.kernel_row()
