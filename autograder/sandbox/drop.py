"""The step before a grading sandbox: least privilege (standard library only, ``python -I -S``).

Every sandbox (:mod:`autograder.sandbox`) is started through this file, whatever its backend:

    python -I -S drop.py CONFIG -- bwrap|unshare ...

It sets the job's limits, gives up every privilege the grader had, and only then executes the
backend, so that nothing a submission runs can inherit them:

* limits per process (``setrlimit``): tasks of the job's uid (processes and threads: a fork bomb
  stops there), address space, CPU seconds, file size, no core dumps; and a nice level, so that a
  job's kernels yield the CPU to the grader and share it with the other jobs;
* a grader started as root switches to the job's own unprivileged uid and gid (no supplementary
  groups) before any namespace exists: the user namespace the backend creates then maps the
  sandbox's users to *that* uid, never to the machine's root, so the kernel's permission checks
  (``/proc/sys``, devices, files owned by root) treat the submission as a stranger. A grader
  started as an ordinary user keeps its uid (it is no root to give away);
* ``no_new_privs`` (no setuid program can give privileges back) and an empty capability bounding set.

CONFIG is a JSON object (on the command line: no file to leave readable), with ``uid``, ``gid`` (used only when started as root), ``nproc``, ``address_space``,
``cpu_seconds``, ``file_size``, ``nice``.
"""
import json
import os
import resource
import sys

PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24


def _prctl(*args):
    import ctypes
    # the libc this interpreter has loaded: ctypes.util.find_library would run ldconfig on every call
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(*[ctypes.c_ulong(a) for a in args])


def _limit(which, value):
    if value is None:
        return
    soft, hard = resource.getrlimit(which)
    value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
    resource.setrlimit(which, (value, value))


def _own_tasks(uid) -> int:
    """Tasks (threads included: RLIMIT_NPROC counts them) the uid runs now."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                st = os.stat(f"/proc/{pid}")
                if st.st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count


def drop(cfg: dict) -> None:
    root = os.geteuid() == 0
    if cfg.get("nice"):
        os.nice(int(cfg["nice"]))
    if root and cfg.get("uid") is not None:
        # the bounding set first: emptying it needs CAP_SETPCAP, which the uid switch takes away
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
        for cap in range(last + 1):
            _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        if os.geteuid() == 0 or os.getegid() == 0:
            raise OSError("still root after dropping privileges")
        nproc = cfg.get("nproc")                  # the uid is the job's own: its tasks are the job's
    else:
        # an ordinary grader's uid runs the grader and every job too: the cap is on top of those
        nproc = None if cfg.get("nproc") is None else cfg["nproc"] + _own_tasks(os.getuid())
    _limit(resource.RLIMIT_NPROC, nproc)
    _limit(resource.RLIMIT_AS, cfg.get("address_space"))
    _limit(resource.RLIMIT_CPU, cfg.get("cpu_seconds"))
    _limit(resource.RLIMIT_FSIZE, cfg.get("file_size"))
    _limit(resource.RLIMIT_CORE, 0)
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")


def main():
    sep = sys.argv.index("--")
    cfg = json.loads(sys.argv[1])
    argv = sys.argv[sep + 1:]
    try:
        drop(cfg)
        os.execv(argv[0], argv)
    except BaseException as err:  # noqa: BLE001  (no sandbox is better than one with privileges)
        print(f"sandbox: could not drop privileges before {argv[:1]}: {err}", file=sys.stderr)
        os._exit(126)


if __name__ == "__main__":
    main()
