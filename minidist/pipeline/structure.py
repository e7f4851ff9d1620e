"""The structural rules of a pipeline schedule, shared by the validator and the simulator.

For every rank and every (micro-batch, chunk) it holds, a schedule must run exactly one
forward, then one B (or one BI followed by one BW); receive its input before the compute
that needs it and send its output after the compute that makes it, to the right rank; and
every send must match the receive at the same position of the same channel (messages
between two ranks match in FIFO order, as in NCCL). Deadlock is the simulator's question
(:mod:`minidist.pipeline.simulator`); :mod:`minidist.pipeline.validator` asks both.
"""
from __future__ import annotations

from collections import defaultdict

from minidist.pipeline.schedules import COMM, COMPUTE, Schedule


class ScheduleError(ValueError):
    """An invalid or deadlocking schedule, raised before anything runs."""


def _message(s: Schedule, rank: int, a) -> tuple:
    """What a communication action carries: (direction, micro-batch, receiving stage)."""
    st = s.stage(rank, a.chunk)
    if a.kind == "SEND_F":
        return ("activation", a.mb, st + 1)
    if a.kind == "SEND_B":
        return ("gradient", a.mb, st - 1)
    return ("activation" if a.kind == "RECV_F" else "gradient", a.mb, st)


def structural_problems(s: Schedule) -> list[str]:
    """Everything but deadlock (see module docstring); empty when fine."""
    out: list[str] = []
    if len(s.actions) != s.p:
        return [f"schedule has programs for {len(s.actions)} ranks but p={s.p}"]
    last = s.num_stages - 1
    channels: dict[tuple, dict[str, list]] = defaultdict(lambda: {"send": [], "recv": []})
    for r, prog in enumerate(s.actions):
        seen: dict[tuple, list[str]] = defaultdict(list)   # (mb, chunk) -> kinds so far
        for i, a in enumerate(prog):
            where = f"rank {r}, action {i} ({a})"
            if a.kind not in COMPUTE + COMM:
                out.append(f"{where}: unknown action kind {a.kind!r}")
                continue
            if not (0 <= a.mb < s.m) or not (0 <= a.chunk < s.v):
                out.append(f"{where}: micro-batch or chunk out of range (m={s.m}, v={s.v})")
                continue
            st, done = s.stage(r, a.chunk), seen[(a.mb, a.chunk)]
            if a.is_comm:
                want = {"SEND_F": st + 1, "RECV_F": st - 1, "SEND_B": st - 1, "RECV_B": st + 1}[a.kind]
                if not 0 <= want <= last:
                    out.append(f"{where}: stage {st} has no neighbour stage {want} to talk to")
                    continue
                if a.peer != want % s.p:
                    out.append(f"{where}: peer should be rank {want % s.p} (holds stage {want})")
                    continue
                if a.kind == "SEND_F" and "F" not in done:
                    out.append(f"{where}: sends an activation before computing it")
                if a.kind == "SEND_B" and not ({"B", "BI"} & set(done)):
                    out.append(f"{where}: sends a gradient before computing it")
                if a.kind.startswith("RECV") and a.kind in done:
                    out.append(f"{where}: receives the same message twice")
                side = "send" if a.kind.startswith("SEND") else "recv"
                src, dst = (r, a.peer) if side == "send" else (a.peer, r)
                channels[(src, dst)][side].append((_message(s, r, a), r, i))
                done.append(a.kind)
                continue
            if a.kind == "F":
                if "F" in done:
                    out.append(f"{where}: rank already holds micro-batch {a.mb} (second forward)")
                if st > 0 and "RECV_F" not in done:
                    out.append(f"{where}: forward before its input is received (no RECV_F)")
            else:
                if "F" not in done:
                    out.append(f"{where}: backward before forward")
                if a.kind in ("B", "BI") and ({"B", "BI"} & set(done)):
                    out.append(f"{where}: second backward of micro-batch {a.mb}")
                if a.kind == "BW" and "BI" not in done:
                    out.append(f"{where}: weight gradient (BW) before input gradient (BI)")
                if a.kind == "BW" and "BW" in done:
                    out.append(f"{where}: second BW of micro-batch {a.mb}")
                if a.kind in ("B", "BI") and st < last and "RECV_B" not in done:
                    out.append(f"{where}: backward before its output gradient is received (no RECV_B)")
            done.append(a.kind)
        for mb in range(s.m):
            for c in range(s.v):
                done, st = seen[(mb, c)], s.stage(r, c)
                what = f"rank {r}, micro-batch {mb}, chunk {c}"
                if "F" not in done:
                    out.append(f"{what}: no forward")
                if not ("B" in done or ("BI" in done and "BW" in done)):
                    out.append(f"{what}: no complete backward (B, or BI and BW)")
                if st < last and "F" in done and "SEND_F" not in done:
                    out.append(f"{what}: activation never sent to stage {st + 1}")
                if st > 0 and ({"B", "BI"} & set(done)) and "SEND_B" not in done:
                    out.append(f"{what}: gradient never sent to stage {st - 1}")
    for (src, dst), ch in sorted(channels.items()):
        sent = {msg for msg, _, _ in ch["send"]}
        got = {msg for msg, _, _ in ch["recv"]}
        for msg, _, i in ch["recv"]:
            if msg not in sent:
                out.append(f"rank {dst} receives the {msg[0]} of micro-batch {msg[1]} from rank {src} "
                           f"(action {i}), but rank {src} never sends it (no matching send)")
        for msg, _, i in ch["send"]:
            if msg not in got:
                out.append(f"rank {src} sends the {msg[0]} of micro-batch {msg[1]} to rank {dst} "
                           f"(action {i}), but rank {dst} never receives it (no matching receive)")
        if sent != got:
            continue
        for k, ((smsg, _, si), (rmsg, _, ri)) in enumerate(zip(ch["send"], ch["recv"])):
            if smsg != rmsg:    # later positions of a broken channel are noise: report the first
                out.append(f"message {k} from rank {src} to rank {dst}: the send (action {si}) carries "
                           f"{smsg} but the receive (action {ri}) expects {rmsg} (messages match in order)")
                break
    return out
