import os
import subprocess

import pytest

from minidist.trace import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Test files that grade with the sandbox and the confirmation: each runs its own pool of jobs (two at
#: a time) or its own confirmations, with the fixture lab's launch and cell timeouts sized for a 2-core
#: machine that does nothing else. They get the marker ``serial``: `make test` runs every other test
#: on two pytest workers (pytest-xdist), then these, one at a time, in one process. (Plain nbgrader's
#: one kernel at a time, tests/test_nbgrader_plain.py, runs with the others.)
SERIAL = ("test_autograder.py", "test_authoring.py", "test_cheats.py", "test_judge.py", "test_labs_selftest.py",
          "test_platforms.py", "test_private_folder.py", "test_sandbox.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def load_slides_builder():
    """slides/build.py as a module (slides/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("slides_build", os.path.join(ROOT, "slides", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def kernel_name():
    """The pinned Jupyter kernel (this venv's python), installed if `make install` did not."""
    return load_slides_builder().ensure_kernel()


def attempt(fn):
    """(exception name, message, collectives recorded before it): bad input must raise before any."""
    with trace() as tr:
        try:
            fn()
            raised = None
        except Exception as err:    # noqa: BLE001  (reported, the test asserts the kind)
            raised = err
    return type(raised).__name__ if raised else None, str(raised), len(tr.comm())



def forbid_starting_processes(monkeypatch):
    """Make fork and Popen fail loudly: for tests that bad input is rejected before any rank starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
