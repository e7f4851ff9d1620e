"""The bundle's setup.sh on a machine whose python3 is too old (Gradescope's Ubuntu 22.04 base image:
Python 3.10, no venv module): it selects an installed Python >= 3.11, or installs one with apt, or
stops with what to install.

The machine is laid out in a folder: PATH holds only stand-ins (a ``python3`` script that reports
3.10, an ``apt-get`` that records its calls and, asked for ``pythonX.Y``, provides it as a link to
this machine's real interpreter, an ``id`` that says root) and links to bash's few tools, so no
real Python on the machine is found. ``setup.sh --python`` stops once the interpreter is chosen
(nothing else is installed); the full setup runs in tests/test_platforms.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.handout.platforms import bundle

REAL = os.path.realpath(sys._base_executable)       # this machine's Python (>= 3.11: the project needs it)
BUILT = f"{sys.version_info.major}.{sys.version_info.minor}"

OLD_PYTHON = """#!/bin/sh
# a stand-in for Ubuntu 22.04's python3: reports 3.10, and records anything else asked of it
echo "$*" >> "{log}"
case "$*" in
  *version_info*) echo 3.10 ;;
  *) echo "stand-in Python 3.10: $*" >&2; exit 1 ;;
esac
"""
NO_VENV = """#!/bin/sh
# a Python {version} whose venv module is missing (Debian's python3.X without python3.X-venv)
case "$*" in
  *ensurepip*) exit 1 ;;
  *version_info*) echo {version} ;;
  *) exit 1 ;;
esac
"""
APT = """#!/bin/sh
# a stand-in apt-get: records its calls; "install pythonX.Y[-venv]" provides pythonX.Y (a link to {real})
echo "$*" >> "{log}"
for pkg in "$@"; do
  case "$pkg" in
    python3.*-venv) /bin/ln -sf "{real}" "{bin}/${{pkg%-venv}}" ;;
    python3.*) /bin/ln -sf "{real}" "{bin}/$pkg" ;;
  esac
done
exit 0
"""


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path):
    """(run setup.sh --python, the folder of stand-ins, the logs): a PATH without any real Python."""
    fake, tools = tmp_path / "bin", tmp_path / "tools"
    fake.mkdir()
    tools.mkdir()
    for tool in ("dirname",):
        (tools / tool).symlink_to(shutil.which(tool))
    logs = {"python3": tmp_path / "python3.log", "apt": tmp_path / "apt.log"}
    script(fake / "python3", OLD_PYTHON.format(log=logs["python3"]))
    script(fake / "id", "#!/bin/sh\necho 0\n")
    setup = script(tmp_path / "setup.sh", bundle.SETUP.replace("@LAB@", "toylab").replace("@TORCH@", "0+cpu"))

    def run(**env):
        environ = {"PATH": f"{fake}:{tools}", "HOME": str(tmp_path), "MINIDIST_VENV": str(tmp_path / "venv"), **env}
        return subprocess.run([shutil.which("bash"), str(setup), "--python"], capture_output=True, text=True,
                              env=environ, timeout=60)
    return run, fake, logs


def with_apt(fake: Path, logs: dict) -> None:
    script(fake / "apt-get", APT.format(log=logs["apt"], real=REAL, bin=fake))


def apt_calls(logs) -> list[str]:
    return logs["apt"].read_text().splitlines() if logs["apt"].exists() else []


def chosen(r) -> str:
    line = next(l for l in r.stdout.splitlines() if l.startswith("setup: python: "))
    return line.removeprefix("setup: python: ")


def test_built_with_python_311_or_later():
    assert f'PY_BUILT="{BUILT}"' in bundle.SETUP and sys.version_info >= (3, 11)


def test_python_310_and_apt_as_root_installs_python(machine):
    run, fake, logs = machine
    with_apt(fake, logs)
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "python3 is Python 3.10: grading needs Python >= 3.11" in r.stdout
    assert f"install -y -qq python{BUILT} python{BUILT}-venv" in apt_calls(logs)
    assert chosen(r) == f"{fake}/python{BUILT} (Python {BUILT})"
    assert "-m venv" not in logs["python3"].read_text()          # the old python3 made nothing
    assert not (fake.parent / "venv").exists()                     # --python stops there


def test_an_installed_python311_is_selected_even_when_PYTHON_names_an_old_one(machine):
    run, fake, logs = machine
    with_apt(fake, logs)
    (fake / "python3.11").symlink_to(REAL)
    for env in ({}, {"PYTHON": str(fake / "python3")}):
        r = run(**env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert chosen(r) == f"{fake}/python3.11 (Python {BUILT})"
    assert apt_calls(logs) == []                                   # nothing installed


def test_a_python_without_its_venv_module_gets_it_from_apt(machine):
    run, fake, logs = machine
    with_apt(fake, logs)
    script(fake / "python3.11", NO_VENV.format(version="3.11"))
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{fake}/python3.11 (Python 3.11) has no venv module" in r.stdout
    assert "install -y -qq python3.11-venv" in apt_calls(logs)
    assert chosen(r).startswith(f"{fake}/python3.11 (Python ")


def test_without_apt_it_stops_and_says_what_to_install(machine):
    run, fake, logs = machine
    r = run()
    assert r.returncode == 1
    assert "no Python >= 3.11 here and apt-get cannot install one" in r.stderr
    assert "PYTHON=/path/to/python3.11" in r.stderr
    script(fake / "python3.11", NO_VENV.format(version="3.11"))    # one without its venv module, no apt
    r = run()
    assert r.returncode == 1 and "cannot make a virtual environment" in r.stderr and "python3.11-venv" in r.stderr


def test_an_old_environment_is_refused_not_kept(machine, tmp_path):
    run, fake, logs = machine
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    script(tmp_path / "venv" / "bin" / "python", OLD_PYTHON.format(log=tmp_path / "venv.log"))
    r = run()
    assert r.returncode == 1 and "holds Python 3.10; grading needs >= 3.11: remove it" in r.stderr
