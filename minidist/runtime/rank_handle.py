"""The parent's handle on one rank: its process, its status page, its output.

The launcher (:mod:`minidist.runtime.launcher`) makes one per rank, starts it (fork or spawn),
polls it, relays its output with a ``[rank r]`` prefix, asks a stuck one for its Python stack
(SIGUSR1: ``faulthandler`` in the rank), and kills its whole process group on every exit path.
:func:`minidist.runtime.failure_report.failure_report` reads the evidence it points at.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from minidist.runtime.failure_report import CRASH_START, NOISE
from minidist.runtime.rank_process import STATUS_BYTES, spawn_entry

OUTPUT_LIMIT = 100_000      # characters relayed per rank; the rest is counted, not printed


class RankHandle:
    """The parent's handle on one rank: its process, status page and output file."""

    def __init__(self, rank, run_dir, dump_dir=None):
        self.rank, self.run_dir, self.dump_dir = rank, run_dir, dump_dir
        self.path = lambda ext: os.path.join(run_dir, f"rank{rank}.{ext}")
        with open(self.path("status"), "wb") as f:
            f.write(b"\0" * STATUS_BYTES)
        open(self.path("out"), "wb").close()
        self.pid = None
        self.popen = None
        self.exit = None            # ("code", n) or ("signal", n) once reaped
        self.out_pos = 0
        self.out_printed = 0
        self.out_partial = b""
        self.crash_output = []     # what it printed from its abort on: folded, not relayed
        self.op_when_stopped = ""

    def start_fork(self, target):
        pid = os.fork()
        if pid == 0:                # the child never returns from here
            code = 1
            try:
                code = target()
            finally:
                os._exit(code)
        self.pid = pid
        try:                        # also here, so a kill right after fork reaches the group
            os.setpgid(pid, pid)
        except OSError:
            pass

    def start_spawn(self, job):
        rank, world_size, kind, run_dir, timeout = job
        out = open(self.path("out"), "wb")
        # Named from the function itself, so the entry point follows the code if it moves.
        entry = f"from {spawn_entry.__module__} import {spawn_entry.__name__}; {spawn_entry.__name__}()"
        cmd = [sys.executable, "-c", entry,
               run_dir, str(rank), str(world_size), kind, str(timeout)]
        self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        out.close()
        self.pid = self.popen.pid

    def poll(self):
        if self.exit is not None or self.pid is None:
            return self.exit
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.exit = ("code", -1)
            return self.exit
        if pid:
            if self.popen is not None:
                self.popen.returncode = os.waitstatus_to_exitcode(status)
            self.exit = ("signal", os.WTERMSIG(status)) if os.WIFSIGNALED(status) else ("code", os.WEXITSTATUS(status))
        return self.exit

    def status(self):
        with open(self.path("status"), "rb") as f:
            raw = f.read(STATUS_BYTES)
        op = raw[32:].split(b"\0", 1)[0].decode(errors="replace")
        return raw[0], raw[1:17].split(b"\0", 1)[0].decode(), op

    def relay_output(self, final=False):
        with open(self.path("out"), "rb") as f:
            f.seek(self.out_pos)
            data = f.read()
        self.out_pos += len(data)
        data = self.out_partial + data
        lines = data.split(b"\n")
        self.out_partial = b"" if final else lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            if (not line and final) or NOISE.search(line):
                continue
            if self.crash_output or CRASH_START.search(line):
                self.crash_output.append(line)
                continue
            if self.out_printed < OUTPUT_LIMIT:
                print(f"[rank {self.rank}] {line}", flush=True)
            elif self.out_printed - len(line) < OUTPUT_LIMIT:
                print(f"[rank {self.rank}] ... output beyond {OUTPUT_LIMIT} characters not shown", flush=True)
            self.out_printed += len(line) + 1
        if final and self.crash_output:
            print(f"[rank {self.rank}] crashed: its dump ({len(self.crash_output)} lines) is folded; "
                  f"the error below says why and where", flush=True)

    def dump_stack(self):
        if self.pid is not None and self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def kill(self):
        if self.pid is None:
            return
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass
        if self.exit is None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.exit = ("killed", signal.SIGKILL)
