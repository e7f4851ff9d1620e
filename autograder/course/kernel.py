"""The pinned grading kernel, ``minidist``: installed into this interpreter's prefix when missing."""
from __future__ import annotations

import shutil
import subprocess
import sys

KERNEL_NAME = "minidist"


def kernel_argv() -> list[str]:
    """Make sure the pinned kernel exists and can import minidist; return its argv.

    Installs it into this interpreter's prefix when missing, i.e. runs
    ``python -m ipykernel install --sys-prefix --name minidist``.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    ksm = KernelSpecManager()
    try:
        spec = ksm.get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        spec = None
    if spec is None or not _kernel_ok(spec.argv):
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix",
                        "--name", KERNEL_NAME, "--display-name", "Python (minidist)"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ksm = KernelSpecManager()
        spec = ksm.get_kernel_spec(KERNEL_NAME)
        if not _kernel_ok(spec.argv):
            raise RuntimeError(f"kernel {KERNEL_NAME!r} ({spec.argv[0]}) cannot import minidist")
    return spec.argv


def _kernel_ok(argv) -> bool:
    exe = shutil.which(argv[0]) if argv else None
    if not exe:
        return False
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('minidist') and u.find_spec('ipykernel') else 1)")
    r = subprocess.run([exe, "-c", probe], capture_output=True)
    return r.returncode == 0
