"""What a failed rank's report says: its exception, or where it was stuck, or why it died.

The launcher (:mod:`minidist.runtime.launcher`) calls :func:`failure_report` for every rank
that did not return a result. The rank's files in the launch's run directory are the
evidence: ``error`` (a formatted exception written by the rank), ``stack`` (faulthandler's
dump when the launcher stopped a stuck rank), ``out`` (everything the rank printed). On CUDA
ranks NCCL's flight recorder may also have dumped the rank's last collectives, outside the run
directory (which the launch removes): the report says where.

:func:`missing_call` reads the reports together: when some ranks returned while their peers
were left inside one operation (blocked in it, or told that the peer was gone), the cause is
the ranks that returned, and it names them, the operation and the peers' line.
"""
from __future__ import annotations

import os
import re
import signal

from minidist.runtime import rank_process
from minidist.runtime.rank_process import format_frame, indent, student_frames

# C++ log lines of c10d/gloo and the profiler's (kineto's) chatter: not the user's output.
NOISE = re.compile(r"^(\[rank\d+\]:)?\[[WIE]\d{4} |^\s*warnings\.warn\(|^(USDT|STAGE):")
# Where a dying rank's C++ abort message and faulthandler's dump start. From there on its output is
# not relayed line by line (90 lines of every thread's frames and the extension modules would bury
# the summary): the report quotes the cause and the user's frames, and :func:`crash_details` keeps
# the crashed thread's frames for the end of the error.
CRASH_START = re.compile(r"^(terminate called after throwing|Fatal Python error: )")


def failure_report(r, timeout: float, user_clock_started: bool) -> str:
    """One rank's report (``r``: the launcher's handle of a rank that returned no result)."""
    report = _report(r, user_clock_started)
    dump = flight_recorder_dump(r)
    return report + (f"\n  NCCL flight recorder dump (its last collectives): {dump}" if dump else "")


# "rank 0 raised: PeerGone: all_reduce(16 B) failed: ..." / "rank 2: blocked in recv(src=1, 16 B)"
_LEFT_IN = re.compile(r"^rank \d+(?: raised: PeerGone: |: blocked in (?:wait\(\) on )?)(\w+)\(", re.MULTILINE)
_FRAME = re.compile(r'File "(.+?)", line (\d+)')


def missing_call(failures: dict[int, str], world_size: int) -> str:
    """"rank 1 returned without calling all_reduce that its peers called at line 7 (f.py)", or "".

    Said only when every failed rank was left inside an operation (blocked in it, or its peer
    gone) and the others returned: then the ranks that returned skipped the call."""
    returned = sorted(set(range(world_size)) - set(failures))
    if not returned or not failures:
        return ""
    ops, lines = set(), set()
    for text in failures.values():
        m = _LEFT_IN.search(text)
        if m is None:
            return ""           # a rank failed for a reason of its own: that is the cause, not this
        ops.add(m.group(1))
        frames = _FRAME.findall(text)
        if frames:
            path, line = frames[-1]          # innermost user frame: where the peers called it
            lines.add(f"line {line} ({path.rsplit('/', 1)[-1]})" if not path.startswith("notebook cell")
                      else f"line {line} of {path}")
    if len(ops) != 1:
        return ""
    who = f"rank {returned[0]}" if len(returned) == 1 else f"ranks {', '.join(map(str, returned))}"
    at = f" at {' / '.join(sorted(lines))}" if lines else ""
    return (f"{who} returned without calling {ops.pop()} that {'its' if len(returned) == 1 else 'their'} peers "
            f"called{at}: every rank of the group must make the same collective calls, in the same order")


_RANK = re.compile(r"^rank (\d+)(?=[: ])")


def ranks_named(ranks) -> str:
    """"rank 3", "ranks 0-7", "ranks 0-2, 5": ranks as a failure names them."""
    ranks = sorted(ranks)
    runs, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _folded(texts: dict[int, str], order) -> list[str]:
    """``texts`` ({rank: text starting "rank r"}) with the ranks whose texts are the same but for their
    number said once, as "ranks 0-7 ...", in ``order`` of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank in order:
        text = texts[rank]
        m = _RANK.match(text)
        key = text[m.end():] if m and int(m.group(1)) == rank else f"\0{rank}\0{text}"   # not foldable
        groups.setdefault(key, []).append(rank)
    out = []
    for key, ranks in groups.items():
        out.append(texts[ranks[0]] if key.startswith("\0") else ranks_named(ranks) + key)
    return out


def fold_reports(failures: dict[int, str], order) -> str:
    """The launch's failure body: every rank's report, those alike but for the rank said once
    ("ranks 0-7 raised: RuntimeError: ...", its frames once)."""
    return "\n".join(_folded(failures, order))


def fold_first_lines(failures: dict[int, str]) -> str:
    """One line for a launch's failure: each distinct first line of the ranks' reports, the ranks
    alike said once ("ranks 0-3 raised: RuntimeError: ..."; a second kind after "; ")."""
    firsts = {rank: (text.splitlines() or [""])[0] for rank, text in failures.items()}
    order = sorted(firsts, key=lambda k: ("PeerGone" in firsts[k], k))
    return "; ".join(_folded(firsts, order))


def flight_recorder_dump(r) -> str | None:
    """The file NCCL's flight recorder wrote for this rank on a timeout, if it wrote one."""
    dump_dir = getattr(r, "dump_dir", None)
    if not dump_dir or not os.path.isdir(dump_dir):
        return None
    mine = sorted(f for f in os.listdir(dump_dir) if re.fullmatch(rf"rank{r.rank}(\D.*)?", f))
    return os.path.join(dump_dir, mine[0]) if mine else None


def _report(r, user_clock_started: bool) -> str:
    if os.path.exists(r.path("error")):
        with open(r.path("error")) as f:
            return f.read().rstrip()
    kind, num = r.exit or ("", 0)
    if kind == "killed":    # we killed it: it was stuck
        _, main_thread, _ = r.status()
        op = r.op_when_stopped
        frames = stack_frames(r.path("stack"), main_thread)
        where = f"blocked in {op}" if op else "busy in Python code (no communication in flight)"
        if not user_clock_started:
            where = "still starting up (process group not joined)"
        return f"rank {r.rank}: {where}\n" + indent(frames or ["(no Python stack available)"])
    if kind == "signal":
        name = signal.Signals(num).name if num in signal.Signals._value2member_map_ else str(num)
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if num == signal.SIGKILL else ""
        # a C++ abort (e.g. gloo's "Received data size doesn't match"): its message and faulthandler's
        # dump of the user's frames say more than the output's last lines
        lines = output_tail(r.path("out"), n=200)
        cause = [l.split("what():", 1)[1].strip() for l in lines if "what():" in l][:1]
        frames = stack_frames(r.path("out"), None) if any("Fatal Python error" in l for l in lines) else []
        body = cause + frames if cause or frames else lines[-8:]
        return f"rank {r.rank}: killed by signal {name}{hint}" + (f"\n{indent(body)}" if body else "")
    if kind == "code" and num == 0:
        return f"rank {r.rank}: exited without returning a result (os._exit(0) inside the function?)"
    tail = output_tail(r.path("out"))
    return f"rank {r.rank}: exited with code {num} without an exception (os._exit()?)" + (f"\n{indent(tail)}" if tail else "")


def crash_details(lines: list[str], limit: int = 25) -> list[str]:
    """The folded crash output worth keeping: the C++ message and the crashed thread's frames
    (faulthandler's "Current thread" block, else its first), without the other threads and
    the list of extension modules."""
    head, blocks = [], []
    for line in lines:
        if line.startswith("Extension modules:"):
            break
        if line.startswith(("Current thread", "Thread 0x")):
            blocks.append([line])
        elif line.strip():
            (blocks[-1] if blocks else head).append(line)
    chosen = next((b for b in blocks if b[0].startswith("Current thread")), blocks[0] if blocks else [])
    kept = head + chosen
    return kept[:limit] + ([f"... ({len(kept) - limit} more lines)"] if len(kept) > limit else [])


def stack_frames(path, main_thread):
    """The main thread's frames from a faulthandler dump, innermost last, library frames dropped."""
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        text = f.read()
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    chosen = next((b for b in blocks if main_thread and main_thread.lower() in b.lower()), blocks[-1] if blocks else "")
    frames = []
    for m in re.finditer(r'File "(.+?)", line (\d+) in (\S+)', chosen):    # innermost first
        filename, line, func = m.group(1), int(m.group(2)), m.group(3)
        if filename == rank_process.__file__:
            break           # rank_main: what lies beyond is the parent's stack, inherited by fork
        frames.append((filename, line, func))
    shown = student_frames(frames, filename=lambda f: f[0])
    return [format_frame(*f) for f in reversed(shown)][-6:]


def output_tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f.readlines() if not NOISE.search(l)]
    except OSError:
        return []
    return lines[-n:]
