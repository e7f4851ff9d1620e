"""The first two steps of a job: its private course, and what was handed in, made gradable.

:meth:`JobCourse.from_template` copies the batch's template course (the lab's source, its release and
the gradebook) into the job's folder. :func:`take_in` finds the submitted notebook(s) (a wrongly named
one accepted and noted), parses them, reads the instructor's flags from their source
(:mod:`.flags`), restores their graded structure from the release (:func:`.notebooks.repair`), and
writes them, demo cells blanked, where nbgrader looks for them; the files handed in next to them are
copied too (:func:`copy_extra_files`: regular files within limits, none named like an installed module).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from autograder.confirm.handed_in import shadows
from autograder.course.cells import read_nb, skip_demos, write_nb
from autograder.course.template import lab_cells
from autograder.grading.worker.flags import notebook_flags
from autograder.grading.worker.notebooks import load, locate, repair

MAX_EXTRA_BYTES = 20 << 20          # files handed in next to the notebook: at most this much is copied
MAX_EXTRA_FILES = 200


@dataclass
class JobCourse:
    """The job's own nbgrader course (``JOB/course``), copied from the batch's template."""
    job: Path                   # the job's folder: its course, its logs
    student: str
    lab: str
    cells_meta: dict            # {notebook: [graded cell]}, :func:`autograder.course.template.lab_cells`
    release_nbs: dict
    source_nbs: dict

    @property
    def root(self) -> Path:
        return self.job / "course"

    @property
    def names(self) -> list[str]:
        return list(self.cells_meta)

    @classmethod
    def from_template(cls, spec: dict) -> JobCourse:
        job, lab, template = Path(spec["job_dir"]), spec["lab"], Path(spec["template"])
        course = job / "course"
        shutil.rmtree(course, ignore_errors=True)
        (course / "source").mkdir(parents=True)
        shutil.copytree(template / "source" / lab, course / "source" / lab)
        shutil.copytree(template / "release" / lab, course / "release" / lab)
        shutil.copy(template / "gradebook.db", course / "gradebook.db")
        cells_meta = lab_cells(course, lab)
        return cls(job, spec["student"], lab, cells_meta,
                   {n: read_nb(course / "release" / lab / f"{n}.ipynb") for n in cells_meta},
                   {n: read_nb(course / "source" / lab / f"{n}.ipynb") for n in cells_meta})


@dataclass
class HandedIn:
    """What was handed in, as the job grades it."""
    folder: Path                # the submission folder
    dest: Path                  # where nbgrader reads it: ``course/submitted/STUDENT/LAB``
    notebooks: dict = field(default_factory=dict)       # {notebook: the repaired notebook}
    unusable: dict = field(default_factory=dict)        # {notebook: why it cannot be graded}
    cell_flags: dict = field(default_factory=dict)      # {notebook: {grade id: [flag]}}
    notes: list = field(default_factory=list)
    used: set = field(default_factory=set)              # the submitted files graded as notebooks


def take_in(course: JobCourse, folder: Path) -> HandedIn:
    """The submission in ``folder`` written into the job's course (see the module's docstring)."""
    handed = HandedIn(folder, course.root / "submitted" / course.student / course.lab)
    handed.dest.mkdir(parents=True)
    if (folder / "timestamp.txt").is_file():
        shutil.copy(folder / "timestamp.txt", handed.dest / "timestamp.txt")
    flags_static: list[str] = []
    names = course.names
    for name in names:
        path, found_notes = locate(folder, name, [n for n in names if n != name], course.release_nbs)
        handed.notes += found_notes
        if path is None:
            handed.unusable[name] = found_notes[0]
            continue
        handed.used.add(path)
        try:
            nb = load(path)
        except ValueError as e:
            handed.unusable[name] = str(e)
            handed.notes.append(str(e))
            continue
        flags_static += notebook_flags(nb)
        nb, flags, nb_notes = repair(nb, course.release_nbs[name], course.source_nbs[name])
        handed.notes += nb_notes
        graded_ids = {m["name"] for m in course.cells_meta[name]}
        for gid, fl in flags.items():  # solution / markdown cells have no results row
            if gid not in graded_ids:
                handed.notes += [f"cell {gid!r}: {f}" for f in fl]
        handed.cell_flags[name] = flags
        handed.notebooks[name] = nb
        write_nb(skip_demos(nb), handed.dest / f"{name}.ipynb")
    handed.notes += copy_extra_files(folder, handed.dest, handed.used)
    if flags_static:
        handed.notes.append("suspicious code (for the instructor; no score change): " + "; ".join(flags_static[:12])
                            + (f"; ... ({len(flags_static)} in all)" if len(flags_static) > 12 else ""))
    return handed


def copy_extra_files(sub_dir: Path, dest: Path, notebooks: set[Path]) -> list[str]:
    """Files handed in next to the notebook(s): copied into the kernel's working folder (regular
    files only, no links, within size limits) and listed, so that the instructor sees them."""
    copied, skipped, total = [], [], 0
    for root, dirs, files in os.walk(sub_dir, followlinks=False):
        dirs[:] = [d for d in dirs if d not in (".ipynb_checkpoints", "__pycache__") and
                   not os.path.islink(os.path.join(root, d))]
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(sub_dir)
            if path in notebooks or name == "timestamp.txt" or name.endswith(".ipynb"):
                continue
            if path.is_symlink() or not path.is_file():
                skipped.append(f"{rel} (a link)")
                continue
            top = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or name.endswith(".py") else None
            if top and shadows(top):
                skipped.append(f"{rel} (named like the standard or installed module {top!r}: refused)")
                continue
            size = path.stat().st_size
            if total + size > MAX_EXTRA_BYTES or len(copied) >= MAX_EXTRA_FILES:
                skipped.append(f"{rel} (over the size limit)")
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / rel)
            copied.append(str(rel))
            total += size
    notes = []
    if copied:
        notes.append("files handed in next to the notebook (importable by the graded code, in the kernel "
                     "and in the confirmation, after minidist): " + ", ".join(copied[:20]) + (" ..." if len(copied) > 20 else ""))
    if skipped:
        notes.append("files handed in but not copied: " + ", ".join(skipped[:10]))
    return notes
