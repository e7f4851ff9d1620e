"""The first process inside a grading sandbox (run by ``unshare`` as PID 1 of new user, mount,
PID, network, IPC and UTS namespaces, after :mod:`autograder.sandbox.drop` has given up the
grader's privileges; standard library only, started with ``python -I -S``).

It builds the sandbox's file system and then runs the command it was given:

* a new root on a tmpfs holding only what the spec names: read-only binds (the interpreter,
  the installed packages, the pristine minidist copy, system libraries) and read-write binds
  (the kernel's private working folder, its connection folder), each ``[source, seen at]``; the
  folders above them are new, 0755, whatever the machine's are (a course in a 0700 home);
* every read-only bind is read-only all the way down (``/sys``'s cgroup and other sub-mounts
  included), and so are ``/proc/sys`` and ``/proc/sysrq-trigger`` of the fresh ``/proc``;
* a fresh minimal ``/dev`` on a tmpfs, the same entries as bubblewrap's: null, zero, full, random,
  urandom, tty (the machine's nodes, bound one by one), a private devpts and ``/dev/shm``, and the
  GPU devices the spec names; the old
  root is detached, so nothing else of the machine is reachable;
* the loopback interface up (gloo's ranks talk over it; no other interface exists);
* the command runs in a user namespace of its own as uid and gid 1000, not 0, with no
  capabilities at all (bounding set emptied, no new privileges): it can neither undo a mount nor
  make a new one, and outside it is the uid the drop step chose, never the machine's root.

When the command exits, this process exits with its status, and the kernel kills every other
process of the PID namespace: nothing a submission started outlives its sandbox.

Usage: ``python -I -S init.py SPEC`` (a JSON object: ``root``, ``ro``, ``rw``, ``cwd``,
``argv``, ``env``, ``tmp_size``, ``shm_size``, ``devices``).
"""
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
INNER_ID = 1000                  # the submission's uid and gid inside
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
#: statvfs flags a remount must keep (the kernel refuses to clear locked ones in a user namespace)
KEEP = {os.ST_NOSUID: 2, os.ST_NODEV: 4, os.ST_NOEXEC: 8, os.ST_NOATIME: 1024, os.ST_NODIRATIME: 2048,
        os.ST_RELATIME: 1 << 21}
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
libc = ctypes.CDLL(None, use_errno=True)


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
        readonly_tree(dest)


def _mountpoints_under(path):
    """``path`` and every mount point below it (from mountinfo, in mount order)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == path or point.startswith(path.rstrip("/") + "/"):
                out.append(point)
    return out or [path]


def readonly_tree(path):
    """Remount ``path`` and every mount below it read-only (a bind's sub-mounts, e.g. /sys's
    cgroup file systems, stay writable otherwise), keeping the flags the kernel locks."""
    for point in _mountpoints_under(path):
        try:
            kept = sum(bit for st, bit in KEEP.items() if os.statvfs(point).f_flag & st)
        except OSError:
            continue
        mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def minimal_dev(dev, devices, shm_size):
    """A fresh /dev with what bubblewrap's ``--dev`` makes (the same entries whichever backend
    runs): the harmless character devices, a private devpts (``pts``, ``ptmx``), the ``fd``/``std*``
    and ``core`` links, a private shm of ``shm_size`` bytes, and the GPU devices asked for."""
    os.makedirs(dev, exist_ok=True)
    mount("dev", dev, "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for name in DEVICES + tuple(os.path.relpath(d, "/dev") for d in devices):
        if os.path.exists("/dev/" + name):
            bind("/dev/" + name, dev + "/" + name, readonly=False)
    os.makedirs(dev + "/shm", exist_ok=True)
    mount("shm", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={int(shm_size)}")
    os.makedirs(dev + "/pts", exist_ok=True)
    try:                             # a new devpts instance: no terminal of the machine's is reachable
        mount("devpts", dev + "/pts", "devpts", MS_NOSUID | 8, "newinstance,ptmxmode=0666,mode=0620")
    except OSError:
        pass                         # an empty pts: nothing in a kernel needs a terminal
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"), ("core", "/proc/kcore")):
        os.symlink(target, dev + "/" + name)
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, "mode=0755,size=64k")   # the tmpfs alone


def loopback_up():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), 0x8913, ifreq))[1]     # SIOCGIFFLAGS
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # SIOCSIFFLAGS, IFF_UP
    finally:
        s.close()


def become_unprivileged():
    """A user namespace of its own, as uid/gid 1000: the namespace's root (which built the
    mounts) is gone for good, and after exec no capability is left in any namespace."""
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_ID} {uid} 1"), ("gid_map", f"{INNER_ID} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def build(spec):
    # the folders made above each bind are 0755 whatever the grader's umask (a 0077 one would leave the
    # job's uid unable to reach the interpreter, the pristine minidist or its own working folder)
    umask = os.umask(0o022)
    try:
        _build(spec)
    finally:
        os.umask(umask)


def _build(spec):
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
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | 8)    # 8: MS_NOEXEC
    for sub in ("/proc/sys", "/proc/sysrq-trigger"):
        if os.path.exists(root + sub):
            mount(root + sub, root + sub, None, MS_BIND | MS_REC)
            readonly_tree(root + sub)
    minimal_dev(root + "/dev", spec.get("devices", []), spec.get("shm_size", 4 << 30))
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
    spec = json.loads(sys.argv[1])
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
            if spec.get("userns"):       # an ordinary grader's sandbox; a root grader's drops to the job's uid next
                become_unprivileged()
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
