"""The first process inside a grading sandbox (run by ``unshare`` as PID 1 of new user, mount,
PID, network, IPC and UTS namespaces; standard library only, started with ``python -I -S``).

It builds the sandbox's file system and then runs the command it was given:

* a new root on a tmpfs holding only what the spec names: read-only binds (the interpreter,
  the installed packages, the pristine minidist copy, system libraries) and read-write binds
  (the kernel's private working folder, its connection folder), each ``[source, seen at]``;
* a private ``/tmp`` (tmpfs), a fresh ``/proc`` for the new PID namespace, ``/dev`` with a
  private ``/dev/shm``; the old root is detached, so nothing else of the machine is reachable;
* the loopback interface up (gloo's ranks talk over it; no other interface exists);
* the command runs with no capabilities at all (bounding set emptied, no new privileges), so it
  can neither undo a mount nor make a new one.

When the command exits, this process exits with its status, and the kernel kills every other
process of the PID namespace: nothing a submission started outlives its sandbox.

Usage: ``python -I -S sandbox_init.py SPEC.json`` (spec: ``root``, ``ro``, ``rw``, ``cwd``,
``argv``, ``env``, ``tmp_size``).
"""
import ctypes
import ctypes.util
import fcntl
import json
import os
import signal
import socket
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src, target, fstype, flags, data=None):
    _check(libc.mount(src.encode() if src else None, target.encode(), fstype.encode() if fstype else None,
                      ctypes.c_ulong(flags), data.encode() if data else None), f"mount {src} {target}")


def bind(src, dest, readonly):
    if os.path.isdir(src):
        os.makedirs(dest, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        open(dest, "a").close()
    mount(src, dest, None, MS_BIND | MS_REC)
    if readonly:
        mount(None, dest, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def loopback_up():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), 0x8913, ifreq))[1]     # SIOCGIFFLAGS
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # SIOCSIFFLAGS, IFF_UP
    finally:
        s.close()


def drop_capabilities():
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def build(spec):
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.makedirs(root, exist_ok=True)
    mount("sandbox", root, "tmpfs", MS_NOSUID, "mode=0755")
    os.makedirs(root + "/tmp", exist_ok=True)       # first, so that binds below /tmp stay visible
    mount("tmp", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec.get('tmp_size', '2g')}")
    for path in spec["ro"]:
        if os.path.islink(path):                     # /bin -> usr/bin on merged-/usr systems
            dest = root + path
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.symlink(os.readlink(path), dest)
        elif os.path.exists(path):
            bind(path, root + path, readonly=True)
    for src, dest in spec["rw"]:                     # [source, seen at]
        bind(src, root + dest, readonly=False)
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    bind("/dev", root + "/dev", readonly=False)
    os.makedirs(root + "/dev/shm", exist_ok=True)
    mount("shm", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=256m")
    old = root + "/.old"
    os.makedirs(old, exist_ok=True)
    _check(libc.syscall(SYS_PIVOT_ROOT, root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
    for d in spec.get("mkdir", []):
        os.makedirs(d, exist_ok=True)
    loopback_up()


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        build(spec)
    except Exception as err:
        print(f"sandbox: could not build the sandbox: {err}", file=sys.stderr)
        os._exit(125)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()                  # its own session: a signal to the launcher's group is forwarded once
            os.chdir(spec.get("cwd") or "/tmp")
            drop_capabilities()
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as err:
            print(f"sandbox: could not start {spec['argv'][0]}: {err}", file=sys.stderr)
        os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):   # PID 1 would ignore them otherwise
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if done == pid:
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
