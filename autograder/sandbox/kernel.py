"""The Jupyter kernel manager that starts nbgrader's kernel in the sandbox (nbclient's own, with the
launch wrapped by :func:`autograder.sandbox.backend.command`). See :mod:`autograder.sandbox`.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from autograder.sandbox.backend import Backend, command, give
from autograder.sandbox.home import inner_env, outer_env

from autograder.course.kernel import OwnKernelManager


@dataclass(frozen=True)
class KernelJob:
    """What one job's kernels need: the sandbox's ``backend`` (None: no sandbox), the private ``home``,
    the ``pristine`` minidist, the job's kill tag variable, the kernel's working folder (``workdir``, a
    copy of what the student handed in, seen at the notebook's path), the job's ``uid``, the sandbox's
    ``tools`` and ``limit``, and ``env``: variables added to the kernel's environment (a retry's timeout
    scale)."""
    backend: Backend | None
    home: str
    pristine: str
    tag_var: str
    workdir: str
    uid: int | None = None
    tools: str | None = None
    limit: dict | None = None
    env: dict = field(default_factory=dict)


def kernel_manager(job: KernelJob) -> type:
    """The kernel manager class for one job's kernels (nbgrader makes its kernel manager from a class
    given in its configuration: the job travels on that class, never in a module global)."""
    return type("JobKernelManager", (SandboxKernelManager,), {"job": job})


class SandboxKernelManager(OwnKernelManager):
    """nbclient's kernel manager, with the grader's own kernel (:class:`OwnKernelManager`, whatever
    kernelspecs the user has) started inside the sandbox (:func:`kernel_manager` makes one per job). The kernel talks to nbclient over Unix sockets in its private home
    (``transport="ipc"``), which its uid can reach (it has no network in a sandbox); its working folder
    and its home are the only writable places it sees."""

    job: KernelJob

    def __init__(self, **kw):
        super().__init__(**kw)
        self.connection_file = os.path.join(self.job.home, "kernel.json")     # the job's uid reads it
        self.transport, self.ip = "ipc", os.path.join(self.job.home, "k")

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        job = self.job
        grader_env = {**(kw.get("env") or os.environ), **job.env}
        env = inner_env(grader_env, job.home, job.pristine, job.tag_var)
        give(job.home, job.uid)          # the connection file jupyter just wrote (mode 0600) included
        if job.backend is None:
            # no sandbox: the drop step alone (the job's uid and limits), in the copy of what was handed
            # in, with the environment a sandbox gives (the pristine minidist, a private home)
            argv = command(None, kernel_cmd, rw=[], cwd=job.workdir, env=env, uid=job.uid, limit=job.limit,
                           tools=job.tools)
            return await super()._async_launch_kernel(argv, **{**kw, "env": env, "cwd": job.workdir})
        cwd = str(kw.get("cwd") or os.getcwd())
        argv = command(job.backend, kernel_cmd, rw=[(job.workdir, cwd), job.home], cwd=cwd, env=env,
                       ro_extra=[job.pristine], uid=job.uid, limit=job.limit, tools=job.tools)
        kw["env"] = outer_env(grader_env, job.tag_var)
        return await super()._async_launch_kernel(argv, **kw)

    async def _async_signal_kernel(self, signum: int) -> None:
        """An interrupt goes to the kernel itself, not to the process group jupyter started: there
        it would hit bwrap first, which dies of it and takes the whole sandbox along."""
        pid = getattr(getattr(self.provisioner, "process", None), "pid", None)
        kernel = _grandchild(pid) if self.job.backend is not None and pid and signum == signal.SIGINT else None
        if kernel is None:
            return await super()._async_signal_kernel(signum)
        try:
            os.kill(kernel, signum)
        except OSError:
            pass

    signal_kernel = _async_signal_kernel          # AsyncKernelManager's are the coroutines themselves


def _grandchild(pid: int) -> int | None:
    """The sandboxed command: the child of the sandbox's first process, itself the child of ``pid``
    (bwrap or unshare; the drop step execs, it adds no process)."""
    from autograder.sandbox.procs import _stat
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                parents[int(d)] = st[1]
    first = [p for p, pp in parents.items() if pp == pid]
    kernel = [p for p, pp in parents.items() if pp in first]
    return kernel[0] if len(first) == 1 and len(kernel) == 1 else None
