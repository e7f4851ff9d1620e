import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session")
def kernel_name():
    """The pinned Jupyter kernel (this venv's python), installed if `make install` did not."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        spec = KernelSpecManager().get_kernel_spec("minidist")
        if os.path.realpath(spec.argv[0]) == os.path.realpath(sys.executable):
            return "minidist"
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install
    install(prefix=sys.prefix, kernel_name="minidist", display_name="Python (minidist)")
    return "minidist"
