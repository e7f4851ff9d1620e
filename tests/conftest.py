import os
import subprocess

import pytest

from minidist.trace import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
