"""The grading kernel, ``minidist``: always the grader's own interpreter, whatever kernelspecs exist.

Notebooks name their kernel ``minidist``, and so may a kernelspec a user installed with
``ipykernel install --user`` from another environment; Jupyter's search path puts the user's folder
before this interpreter's prefix, so looking the name up would start that other interpreter (which the
sandbox does not hold). The grader therefore never looks kernels up: :class:`OwnKernelSpecManager`
answers every name with this interpreter's ``ipykernel_launcher``, and :class:`OwnKernelManager` (the
base of the sandbox's manager, and the selftest's) uses it. It talks to its kernel over Unix sockets in a
folder of its own (``transport="ipc"``): a TCP port is chosen free by the manager and bound later by the
kernel, and two kernels started at once (``--jobs 2``) could choose the same one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from traitlets import default

KERNEL_NAME = "minidist"


def own_argv() -> list[str]:
    """The kernel command: this interpreter's ipykernel (``{connection_file}`` filled in by Jupyter)."""
    return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]


class OwnKernelSpecManager(KernelSpecManager):
    """Every kernel name resolves to this interpreter's kernel; no kernelspec folder is read."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=own_argv(), display_name="Python (minidist)", language="python",
                          metadata={"debugger": False}, resource_dir="")

    def find_kernel_specs(self) -> dict[str, str]:
        return {KERNEL_NAME: ""}


class OwnKernelManager(AsyncKernelManager):
    """nbclient's kernel manager, starting this interpreter's kernel whatever the notebook names, over
    Unix sockets in a private folder (removed at the kernel's shutdown)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.socket_dir = tempfile.mkdtemp(prefix="minidist-kernel-")
        self.transport, self.ip = "ipc", os.path.join(self.socket_dir, "k")

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    cleanup_resources = _async_cleanup_resources

    @default("kernel_spec_manager")
    def _kernel_spec_manager_default(self) -> KernelSpecManager:
        return OwnKernelSpecManager(data_dir=self.data_dir)


def kernel_argv() -> list[str]:
    """The grading kernel's argv (this interpreter's), once it is known to import minidist and
    ipykernel; a clear error otherwise (the grader was installed without them)."""
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('minidist') and u.find_spec('ipykernel') else 1)")
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode != 0:
        raise RuntimeError(f"the grader's interpreter ({sys.executable}) cannot import minidist and "
                           "ipykernel: install the grader with `make install`")
    return own_argv()
