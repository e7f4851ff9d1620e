"""What a grading machine installs to grade one lab: the same bundle for Gradescope and PrairieLearn.

``make_bundle(lab, dest)`` writes into ``dest``:

* ``wheels/minidist-*.whl``: the library alone (the kernels and the confirmation import it), built
  from this checkout as the student wheel is, without any lab's hidden case tables; the grader's own
  code is not in it, so a sandbox that binds the interpreter's packages read-only shows no grader, bug
  bank, source notebook or hidden case;
* ``course/autograder/`` (the grader), ``course/solutions/LAB/`` (the lab's nbgrader source notebook
  **without its solutions**: every solution region emptied, so that nbgrader makes the same release
  from it, with the test cells and their hidden tests; never the lab's bug bank) and ``course/hidden/``
  (the hidden case tables of the checks the lab imports, which the confirmation gets from the grader,
  :mod:`autograder.confirm.hidden_tables`): the grader runs from ``course/``, which no sandbox shows
  and which ``setup.sh`` makes root's alone (mode 0700: where no sandbox works, a job runs as its own
  unprivileged uid, :func:`autograder.sandbox.backend.command`);
* ``requirements.txt``: the grader's packages pinned at the versions of the interpreter that built
  the bundle (the versions this grader was tested with);
* ``setup.sh``: a virtual environment ``venv/`` next to it (or ``$MINIDIST_VENV``; one already there is
  kept, and what it holds at the pinned versions is not installed again) with the pinned
  CPU build of torch (from a local wheel where the machine keeps one, found as the Makefile finds
  it, else from PyTorch's CPU index), the requirements, the minidist wheel and the ``minidist``
  kernel; bubblewrap where apt can install it. Everything is fetched here, at setup: grading fetches
  nothing.
"""
from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

from autograder import PACKAGE_DIR
from autograder.course.cells import BEGIN_SOLUTION, END_SOLUTION, nbg, read_nb, write_nb
from autograder.handout.wheel import hidden_tables, minidist_wheel

#: the packages grading imports (torch apart: it is installed first, its CPU build)
PINNED = ["numpy", "cloudpickle", "matplotlib", "nbgrader", "nbconvert", "nbformat", "nbclient", "jupyter_client",
          "ipykernel", "jsonschema"]

SETUP = r"""#!/usr/bin/env bash
# minidist's grader for @LAB@: installs everything grading needs, once (nothing is fetched while grading).
# Made by `python -m autograder gradescope|prairielearn @LAB@`; see autograder/README.md.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MINIDIST_VENV:-$HERE/venv}"
TORCH_VERSION="@TORCH@"
PY_BUILT="@PYVER@"      # the Python the bundle was built (and its packages pinned) with

# --- Python >= 3.11 (the pinned numpy, matplotlib and ipykernel need it) with its venv module.
# Gradescope's Ubuntu 22.04 image has Python 3.10 and no venv module: an installed python3.11+ is
# used, else apt installs python$PY_BUILT (or python3.11) with its -venv package where apt works as
# root; anywhere else setup stops and says what to install. `setup.sh --python` stops after this part.
say() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }
pyver() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
new_enough() {
    local v
    v="$(pyver "$1")" || return 1
    [[ "$v" =~ ^3\.([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge 11 ]
}
has_venv() { "$1" -c 'import venv, ensurepip' >/dev/null 2>&1; }     # Debian splits ensurepip off
apt_root() { command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; }
APT_FRESH=""
apt_install() {
    if [ -z "$APT_FRESH" ]; then apt-get update -qq || true; APT_FRESH=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
find_python() {          # SEL: the first Python >= 3.11 of $PYTHON, python3 and python3.N on PATH
    local c p
    for c in "${PYTHON:-python3}" python3 "python$PY_BUILT" python3.14 python3.13 python3.12 python3.11; do
        p="$(command -v "$c" 2>/dev/null)" || continue
        if new_enough "$p"; then SEL="$p"; return 0; fi
    done
    return 1
}
choose_python() {
    find_python && return 0
    local v want
    v="$(pyver "${PYTHON:-python3}" || true)"
    say "${PYTHON:-python3} is ${v:+Python }${v:-missing}: grading needs Python >= 3.11"
    apt_root || die "no Python >= 3.11 here and apt-get cannot install one (it needs apt and root): install \
Python 3.11 or later with its venv module, then run setup.sh again with PYTHON=/path/to/python3.11"
    for want in "$PY_BUILT" 3.11; do
        say "installing python$want and python$want-venv with apt-get"
        if apt_install "python$want" "python$want-venv" && find_python; then return 0; fi
    done
    die "apt-get could not install python$PY_BUILT or python3.11 (Ubuntu 22.04 has python3.11 in its \
universe component): install Python 3.11 or later with its venv module, then run setup.sh again with PYTHON=/path/to/it"
}
ensure_venv() {          # the interpreter's venv module, from apt where Debian/Ubuntu split it off
    has_venv "$1" && return 0
    local v
    v="$(pyver "$1")"
    say "$1 (Python $v) has no venv module"
    if apt_root; then
        say "installing python$v-venv with apt-get"
        { apt_install "python$v-venv" || apt_install python3-venv || true; } && has_venv "$1" && return 0
    fi
    die "$1 cannot make a virtual environment: install its venv module (Debian/Ubuntu: python$v-venv), then \
run setup.sh again"
}
if [ -x "$VENV/bin/python" ]; then       # run again, setup keeps the environment
    new_enough "$VENV/bin/python" || die "$VENV holds Python $(pyver "$VENV/bin/python" || echo '(unknown)'); \
grading needs >= 3.11: remove it (or set MINIDIST_VENV to another folder) and run setup.sh again"
    SEL="$VENV/bin/python"
else
    choose_python
    ensure_venv "$SEL"
fi
say "python: $SEL (Python $(pyver "$SEL"))"
if [ "${1:-}" = "--python" ]; then exit 0; fi

# the sandbox: bubblewrap where apt can install it (else the grader tries unshare, and says what it used)
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || echo "setup: bubblewrap not installed"
fi

[ -x "$VENV/bin/python" ] || "$SEL" -m venv "$VENV"
PY="$VENV/bin/python"
PYTAG="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"

# torch's pinned CPU build: from a local wheel where this machine keeps one (pip's find-links folders
# and /opt/wheels, as the Makefile looks), else from PyTorch's CPU index
TORCH_WHEEL=""
for d in ${PIP_FIND_LINKS//file:\/\//} $("$PY" -m pip config get global.find-links 2>/dev/null || true) /opt/wheels; do
    for w in "$d"/torch-"$TORCH_VERSION"-"$PYTAG"-*.whl; do
        if [ -f "$w" ]; then TORCH_WHEEL="$w"; break 2; fi
    done
done
if [ -n "$TORCH_WHEEL" ]; then
    "$PY" -m pip install --quiet "$TORCH_WHEEL"
else
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install --quiet -r "$HERE/requirements.txt"
"$PY" -m pip install --quiet --no-deps --force-reinstall "$HERE"/wheels/minidist-*.whl
"$PY" -m ipykernel install --sys-prefix --name minidist --display-name "Python (minidist)" >/dev/null
cd "$HERE/course" && "$PY" -c "import minidist, nbgrader, torch, autograder.grading.batch; print('setup: ok, torch', torch.__version__)"
# the grader's files (its code, the lab without solutions, the hidden cases) are root's alone: a job that
# runs without a sandbox runs as an unprivileged uid of its own, and must not read them
# (the environment, the bundle's folder and the wheel stay readable: every job runs that interpreter)
chmod a+rx "$HERE" && chmod -R a+rX "$VENV" "$HERE/wheels"
if [ "$(id -u)" = 0 ]; then chown -R 0:0 "$HERE/course" && chmod -R go-rwx "$HERE/course"; fi
""".replace("@PYVER@", f"{sys.version_info.major}.{sys.version_info.minor}")


def requirements() -> str:
    """The grader's packages at the versions installed here."""
    lines = []
    for name in PINNED:
        try:
            lines.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run `make install` first") from None
    return "\n".join(lines) + "\n"


def torch_version() -> str:
    v = metadata.version("torch")
    return v if "+" in v else v + "+cpu"          # a CPU build: grading machines have no GPU


def without_solutions(nb):
    """A copy of source notebook ``nb`` with every solution emptied, from which nbgrader makes the same
    release: a solution region keeps its two marker lines and loses what lies between (nbgrader's
    ``ClearSolutions`` puts its stub in place of the whole region), a solution cell without markers loses
    its whole text (nbgrader puts its stub in place of the cell). Test cells, their hidden tests and the
    lab's own cells stay as they are."""
    import copy
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if not nbg(cell).get("solution"):
            continue
        lines, kept, inside = cell.source.split("\n"), [], False
        for line in lines:
            if BEGIN_SOLUTION.removeprefix("### ") in line:
                inside = True
                kept.append(line)
            elif END_SOLUTION.removeprefix("### ") in line:
                inside = False
                kept.append(line)
            elif not inside:
                kept.append(line)
        cell.source = "\n".join(kept) if any(BEGIN_SOLUTION.removeprefix("### ") in l for l in lines) else ""
        if cell.cell_type == "code":
            cell.outputs = []
    return out


def grading_files(lab: str, course: Path) -> None:
    """What grading ``lab`` reads of the course, in ``course``: ``solutions/LAB/`` without solutions
    (its notebooks through :func:`without_solutions`, its other files as they are, but its bug bank,
    which grading never reads) and ``hidden/`` (the hidden case tables of every checks module the lab's
    notebooks import)."""
    from autograder.confirm.hidden_tables import CHECKS_PACKAGE, checks_modules, table_file
    from autograder.course.labs import BANK_FILE, solutions_dir
    lab_src = solutions_dir() / lab
    if not lab_src.is_dir():
        raise SystemExit(f"no lab {lab} under {solutions_dir()}")
    shutil.copytree(lab_src, course / "solutions" / lab,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.ipynb", BANK_FILE))
    sources = []
    for path in sorted(lab_src.glob("*.ipynb")):
        nb = read_nb(path)
        write_nb(without_solutions(nb), course / "solutions" / lab / path.name)
        sources += [c.source for c in nb.cells if c.cell_type == "code" and nbg(c).get("locked")]
    for module in sorted(set(checks_modules(sources).values())):
        table = table_file(module)
        if table is not None:
            target = course / "hidden" / module[len(CHECKS_PACKAGE):] / "hidden.py"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(table, target)


def make_bundle(lab: str, dest: Path) -> Path:
    """Everything to grade ``lab`` on another machine, in ``dest`` (see the module's docstring)."""
    dest = Path(dest)
    course = dest / "course"
    grading_files(lab, course)
    minidist_wheel(dest / "wheels", leave_out=hidden_tables())
    shutil.copytree(PACKAGE_DIR, course / "autograder", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / "requirements.txt").write_text(requirements())
    setup = dest / "setup.sh"
    setup.write_text(SETUP.replace("@LAB@", lab).replace("@TORCH@", torch_version()))
    setup.chmod(0o755)
    return dest
