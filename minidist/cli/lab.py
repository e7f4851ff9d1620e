"""``minidist lab copy N DEST``: a student's own copy of lab N, outside the repository.

Working in a copy keeps ``labs/`` as released (``git pull`` and a re-release never meet a
student's edits) and a second copy never overwrites the first. The labs are the repository's
``labs/`` (a clone, minidist installed from it), else ``labs/`` in the current folder (the student
distribution, ``python -m autograder student-dist``, with minidist installed from its wheel).
"""
from __future__ import annotations

import glob
import os
import shutil

LABS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "labs")


def labs_dir() -> str:
    """The repository's labs/ where minidist runs from a clone, else ./labs (the student distribution)."""
    return LABS if os.path.isdir(LABS) else os.path.abspath("labs")


DESCRIPTION = """\
Copy a lab's folder (labs/labN_*) out of the repository or out of the student distribution (run
it in the folder that holds labs/), to work in your own copy. The copy is always DEST/labN_name
(DEST is created when missing), so every lab you copy to the same DEST sits side by side under its
own name. Nothing is ever overwritten."""

EPILOG = """\
examples:
  minidist lab copy 1 ~/minidist-work                # makes ~/minidist-work/lab1_collectives
  .venv/bin/jupyter lab ~/minidist-work/lab1_collectives"""


def lab_folders() -> dict[int, str]:
    """Lab number -> its released folder in labs/."""
    out = {}
    for path in sorted(glob.glob(os.path.join(labs_dir(), "lab[0-9]*_*"))):
        number = os.path.basename(path)[3:].split("_")[0]
        if os.path.isdir(path) and number.isdigit():
            out[int(number)] = path
    return out


def numbers_text(numbers) -> str:
    """'1-9' for a run of numbers, '1, 2, 4' otherwise (what the help and the errors list)."""
    numbers = sorted(numbers)
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(map(str, numbers))


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="lab_command", required=True, metavar="copy")
    copy = sub.add_parser("copy", help="copy labs/labN_* to DEST (never overwriting)", description=DESCRIPTION,
                          epilog=EPILOG, formatter_class=p.formatter_class)
    copy.set_defaults(error=copy.error)
    copy.add_argument("number", type=int, metavar="N", help=f"the lab's number ({numbers_text(lab_folders()) or 'none released'})")
    copy.add_argument("dest", metavar="DEST", help="the folder to put the lab's folder in (created when missing)")


def run(args, error) -> int:
    folders = lab_folders()
    if not folders:
        error(f"no labs found in {labs_dir()} (lab copy works from a clone of the repository, or in the folder "
              f"of the student distribution that holds labs/)")
    if args.number not in folders:
        error(f"there is no lab {args.number}; the labs are {numbers_text(folders)}")
    source = folders[args.number]
    dest = os.path.abspath(os.path.expanduser(args.dest))
    target = os.path.join(dest, os.path.basename(source))
    if os.path.lexists(dest) and not os.path.isdir(dest):
        error(f"{dest} exists and is not a folder (choose another DEST)")
    if os.path.lexists(target):
        error(f"{target} already exists; refusing to overwrite it (choose another DEST)")
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as e:
        error(f"cannot create {dest}: {e.strerror}")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    notebooks = sorted(glob.glob(os.path.join(target, "*.ipynb")))
    print(f"copied {source} to {target}")
    if notebooks:
        print(f"open it with: jupyter lab {notebooks[0]}   (kernel \"Python (minidist)\")")
    return 0
