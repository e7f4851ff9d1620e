"""Run a child in its own session and kill everything it started (Linux /proc based).

Jupyter starts kernels in a *new* session (jupyter_client's launcher), so killing the
worker's process group alone would leave the kernel and its rank processes behind.
Every process of a job therefore carries an environment tag; at the end we kill the
worker's process group, its session, every descendant, and every process whose
environment carries the tag, repeating until none is left.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

TAG_VAR = "MINIDIST_AUTOGRADER_JOB"


def _stat(pid: int):
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    # state, ppid, pgrp, session
    return rest[0], int(rest[1]), int(rest[2]), int(rest[3])


def _has_tag(pid: int, tag: bytes) -> bool:
    try:
        return tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def job_processes(tag: str, root_pid: int | None = None) -> set[int]:
    """Live processes belonging to a job: tagged, or in the root's group/session, or descendants."""
    me = os.getpid()
    want = f"{TAG_VAR}={tag}".encode()
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            s = _stat(int(d))
            if s is not None and s[0] != "Z":
                stats[int(d)] = s
    found = {pid for pid in stats if _has_tag(pid, want)}
    if root_pid is not None:
        found |= {pid for pid, s in stats.items() if s[2] == root_pid or s[3] == root_pid}
        frontier = {root_pid} | found
        while frontier:
            kids = {pid for pid, s in stats.items() if s[1] in frontier and pid not in found}
            found |= kids
            frontier = kids
        if root_pid in stats:
            found.add(root_pid)
    found.discard(me)
    return found


def kill_job(tag: str, root_pid: int | None = None, rounds: int = 20) -> int:
    """SIGKILL every process of the job; returns how many were killed."""
    killed = set()
    quiet = 0
    for _ in range(rounds):
        pids = job_processes(tag, root_pid)
        if root_pid is not None:
            try:
                os.killpg(root_pid, signal.SIGKILL)
            except OSError:
                pass
        if not pids:
            quiet += 1
            if quiet >= 2:
                break
            time.sleep(0.05)
            continue
        quiet = 0
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.05)
    return len(killed)
