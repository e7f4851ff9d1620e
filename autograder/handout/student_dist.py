"""``python -m autograder student-dist OUT``: what students get, without the answer key.

OUT holds three things:

* ``labs/``: the released labs, copied from this repository's ``labs/`` (or ``--labs-dir``;
  ``python -m autograder release`` writes it from ``solutions/``: run that first after changing a lab),
  never a bug bank (``bugbank.py``: a release has none; one left there by hand is not copied);
* ``wheels/minidist-<version>-py3-none-any.whl``: the ``minidist`` library alone, built from a staged
  copy of ``minidist/`` that leaves out every lab's hidden cases (``minidist/checks/<lab>/hidden.py``).
  ``autograder/`` (the grader) and ``solutions/`` (the solutions, the bug banks) are never staged. The visible checks
  and the library's own implementations (which students read after each lab) are in it; asking for
  the hidden cases there raises one line saying they run in the grader
  (:mod:`minidist.checks.kit.withheld`);
* ``README.md``: how a student installs it and works (:data:`README`).

The wheel is built offline as the grading platforms' wheel is
(:func:`autograder.handout.wheel.minidist_wheel`: ``pip wheel --no-deps --no-build-isolation`` on a
staged copy of ``minidist/``), less the hidden tables. The grader keeps using the repository's full checks.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from autograder.course.labs import BANK_FILE, labs_dir
from autograder.handout.wheel import hidden_tables, minidist_wheel, wheel_problems

PARTS = ("labs", "wheels", "README.md")          # what OUT holds; nothing else is written or removed


def build(out: Path) -> dict:
    """Write the student distribution into ``out`` (created; an earlier distribution there is
    replaced; a folder holding anything else is refused). Returns {"labs": [...], "wheel": path,
    "readme": path}."""
    out = Path(out).resolve()
    if out.exists():
        other = sorted(p.name for p in out.iterdir() if p.name not in PARTS)
        if other:
            raise ValueError(f"{out} holds other files ({', '.join(other[:5])}): choose an empty or new folder")
    labs = sorted(p for p in labs_dir().glob("lab[0-9]*_*") if p.is_dir())
    if not labs:
        raise ValueError(f"no released labs in {labs_dir()}: run `python -m autograder release` first")
    with tempfile.TemporaryDirectory(prefix="minidist-student-") as tmp:
        fresh = Path(tmp) / "wheels"
        # the wheel describes itself to students (pip show), not as the instructors' repository does
        wheel = minidist_wheel(fresh, leave_out=hidden_tables(), readme=WHEEL_README)
        problems = wheel_problems(wheel)
        if problems:
            raise RuntimeError("the student wheel holds what it must not:\n" + "\n".join(problems))
        for part in PARTS:
            target = out / part
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(fresh, out / "wheels")
    for lab in labs:
        shutil.copytree(lab, out / "labs" / lab.name,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", BANK_FILE))
    wheel = out / "wheels" / wheel.name
    # by number, not by name: "lab10_..." sorts before "lab1_..."
    number, first = min((int(p.name[3:].split("_")[0]), p.name) for p in labs)
    (out / "README.md").write_text(README.format(wheel=wheel.name, number=number, first=first))
    return {"labs": [p.name for p in labs], "wheel": wheel, "readme": out / "README.md"}


WHEEL_README = """\
# minidist

The library of the minidist labs on distributed training: collectives built from send/recv, data
parallelism, ZeRO and FSDP, pipeline schedules, tensor, context and expert parallelism, a 3D mesh,
memory techniques and sharded checkpoints, on `torch.distributed` (gloo on CPU, NCCL on GPUs), with
the labs' visible checks. `minidist doctor` checks a machine; `minidist lab copy N DEST` copies lab N
out of a course's `labs/` folder. Your course hands out the labs and says how to submit them.
"""

README = """\
# minidist: the labs

This folder is what you need to do the labs: the lab notebooks (`labs/`) and the `minidist` library
they use (`wheels/{wheel}`).

## Install

In a fresh virtual environment (Python 3.10 or newer):

    python -m venv ~/minidist-env
    source ~/minidist-env/bin/activate
    pip install wheels/{wheel} jupyterlab ipykernel
    python -m ipykernel install --user --name minidist --display-name "Python (minidist)"

pip also installs what the library needs (torch, numpy, matplotlib, cloudpickle, safetensors). On a
machine without a GPU, install a CPU build of torch first (`pip install torch --index-url
https://download.pytorch.org/whl/cpu`) so pip does not fetch the much larger CUDA one.

On a JupyterHub, the same `pip install wheels/{wheel}` goes into the image your course uses (or
your own environment on the hub); the notebooks run on the "Python (minidist)" kernel.

Then check the machine:

    minidist doctor

It says which backends and GPUs it found, whether ranks launch, and whether Jupyter and the
"Python (minidist)" kernel are ready.

## Work on a lab

In this folder (the one that holds `labs/`):

    minidist lab copy {number} ~/minidist-work
    jupyter lab ~/minidist-work/{first}

`lab copy` copies a lab into a folder of your own and never overwrites anything, so `labs/` stays as
handed out. Fill in the answer cells and run the test cells: a test cell that finishes without an
error has passed.

## Hidden tests

The test cells you can run are the visible tests. Your submission is also graded by hidden tests
(more sizes, dtypes and edge cases), which run in the course's grader only: a check called with
`hidden=True` here stops with one line saying so. Pass the visible tests and think about the cases
the lab text names.
"""
