"""``minidist doctor``: what this machine can run, one row per check (PASS, FAIL, or SKIP
with the reason it cannot run here).

Besides torch, the backends, GPUs and rank launches, it checks what a student needs for the
labs: the "Python (minidist)" Jupyter kernel exists and runs this interpreter, ``jupyter``
runs, and how long a 4-rank launch takes here (every lab test launches ranks).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time

from minidist.cli.output import wrap

KERNEL = "minidist"                      # the kernel `make install` registers as "Python (minidist)"
# for a student who installed the wheel as much as for a checkout (where `make install` does all of it)
JUPYTER_FIX = f"{sys.executable} -m pip install jupyterlab ipykernel (in a checkout of minidist: make install)"


def in_checkout() -> bool:
    """Whether this minidist is a checkout of the repository (its Makefile beside the package, with the
    GPU suite), not the wheel a student installed: the doctor names only what the student has."""
    from pathlib import Path
    import minidist
    makefile = Path(minidist.__file__).resolve().parents[1] / "Makefile"
    try:
        return "test-gpu:" in makefile.read_text()
    except OSError:
        return False


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
            start = time.perf_counter()
            out = minidist.launch(all_reduce_check, n, device=device, timeout=60, **kw)
            launched[(n, device, kw.get("start_method", "fork"))] = time.perf_counter() - start
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

    def lab_speed_row():
        seconds = launched.get((4, "cpu", "fork"))
        if seconds is None:
            raise Skip("the 4-rank CPU launch above did not run")
        where = "docs/VERIFICATION.md" if checkout else "the labs folder's README.md"
        return (f"a 4-rank launch (start, all-reduce, exit) took {seconds:.1f} s here; every lab test "
                f"launches ranks like this, so the labs run slower or faster in proportion "
                f"({where}: Time per lab)")

    gpus, launched, checkout = visible_gpus(), {}, in_checkout()
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
        ("lab speed", lab_speed_row),
        ("jupyter", jupyter_row),
        ("kernel Python (minidist)", kernel_row),
    ] + [(f"GPU suite, {n} GPU{'s' if n > 1 else ''}", suite_row(n, what)) for n, what in GPU_SUITE_LEVELS
         if checkout]           # the GPU suite is the repository's tests: a student's install has none


def _jupyter() -> str | None:
    """The jupyter next to this interpreter (the venv's), else the first on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "jupyter")
    return here if os.access(here, os.X_OK) else shutil.which("jupyter")


def jupyter_row() -> str:
    """``jupyter lab`` runs (SKIP where Jupyter is not installed at all: not a lab machine)."""
    jupyter = _jupyter()
    if not jupyter:     # a node that only runs scripts (torchrun) needs none; a student's machine does
        raise Skip(f"no jupyter next to this Python or on PATH; the labs need it: {JUPYTER_FIX}")
    out = subprocess.run([jupyter, "lab", "--version"], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"{jupyter} lab --version failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return f"{jupyter}: JupyterLab {out.stdout.strip()}"


def kernel_row() -> str:
    """The labs' kernel is installed and runs this interpreter (same sys.prefix), not another venv's."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except ImportError:
        raise Skip(f"Jupyter is not installed; the labs need it: {JUPYTER_FIX}") from None
    fix = f"{sys.executable} -m ipykernel install --sys-prefix --name {KERNEL} --display-name 'Python (minidist)'"
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
    except NoSuchKernel:
        raise RuntimeError(f"not installed; run: {fix}") from None
    try:
        probe = subprocess.run([spec.argv[0], "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                               timeout=60)
        prefix = probe.stdout.strip() if probe.returncode == 0 else None
    except OSError:             # the kernel's interpreter is gone (a deleted venv)
        prefix = None
    if prefix is None or os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        raise RuntimeError(f"it runs {spec.argv[0]}, not this interpreter ({sys.executable}); run: {fix}")
    return f"installed, runs {spec.argv[0]}"


def _require(ok, message):
    if not ok:
        raise RuntimeError("missing")
    return message


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="the rows as JSON")


def run(args, error) -> int:
    return doctor(args.json)


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
        print(json.dumps(rows, indent=2, default=str))
    else:
        for row in rows:
            print(wrap(f"{row['status']}  {row['check']:<30} {row['detail']}", hanging=" " * 37))
    return 0 if all(r["ok"] for r in rows) else 1
