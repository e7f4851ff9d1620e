"""``minidist lab copy N DEST``: a student's own copy of lab N, outside the repository.

Working in a copy keeps ``labs/`` as released (``git pull`` and a re-release never meet a
student's edits) and a second copy never overwrites the first.
"""
from __future__ import annotations

import glob
import os
import shutil

LABS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "labs")

DESCRIPTION = """\
Copy a lab's folder (labs/labN_*) out of the repository, to work in your own copy. DEST is the
new folder; if DEST is an existing folder, the lab's folder is made inside it. Nothing is ever
overwritten."""

EPILOG = """\
examples:
  minidist lab copy 1 ~/minidist-work                # makes ~/minidist-work/lab1_collectives
  .venv/bin/jupyter lab ~/minidist-work/lab1_collectives"""


def lab_folders() -> dict[int, str]:
    """Lab number -> its released folder in labs/."""
    out = {}
    for path in sorted(glob.glob(os.path.join(LABS, "lab[0-9]*_*"))):
        number = os.path.basename(path)[3:].split("_")[0]
        if os.path.isdir(path) and number.isdigit():
            out[int(number)] = path
    return out


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="lab_command", required=True, metavar="copy")
    copy = sub.add_parser("copy", help="copy labs/labN_* to DEST (never overwriting)", description=DESCRIPTION,
                          epilog=EPILOG, formatter_class=p.formatter_class)
    copy.set_defaults(error=copy.error)
    copy.add_argument("number", type=int, metavar="N", help="the lab's number (1-7)")
    copy.add_argument("dest", metavar="DEST", help="the folder to create (or an existing folder to put it in)")


def run(args, error) -> int:
    folders = lab_folders()
    if not folders:
        error(f"no labs found in {LABS} (lab copy works from a clone of the repository)")
    if args.number not in folders:
        error(f"there is no lab {args.number}; the labs are {', '.join(map(str, sorted(folders)))}")
    source = folders[args.number]
    dest = os.path.expanduser(args.dest)
    target = os.path.join(dest, os.path.basename(source)) if os.path.isdir(dest) else dest
    if os.path.lexists(target):
        error(f"{target} already exists; refusing to overwrite it (choose another DEST)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
        error(f"{os.path.dirname(os.path.abspath(target))} does not exist")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    notebooks = sorted(glob.glob(os.path.join(target, "*.ipynb")))
    print(f"copied {os.path.relpath(source)} to {target}")
    if notebooks:
        print(f"open it with: jupyter lab {notebooks[0]}   (kernel \"Python (minidist)\")")
    return 0
