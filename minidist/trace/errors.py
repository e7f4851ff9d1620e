"""Communication failures said in terms of the operation the user called.

A deadlock or a crashed peer surfaces as the backend's own wording, which names neither the
user's call nor the cause. :func:`explain` recognises that wording, gloo's and NCCL's, and
returns :class:`CommTimeout` ("nobody posted the other half") or :class:`PeerGone`
("the other side is no longer there"), which the launcher reports with the rank and line.
"""
from __future__ import annotations

import re


class ForbiddenOperation(RuntimeError):
    """Raised when a guarded region calls an operation it does not allow."""


class CommTimeout(RuntimeError):
    """An operation outlived the process-group timeout: nobody posted its other half."""


class PeerGone(RuntimeError):
    """The rank on the other side of an operation exited or crashed."""


# Timeouts. gloo: "Timed out waiting 1500ms for recv operation to complete".
# NCCL (ProcessGroupNCCL.cpp): the watchdog's "Watchdog caught collective operation timeout:
# WorkNCCL(SeqNum=1, OpType=ALLREDUCE, ...) ran for 600081 milliseconds before timing out.",
# with TORCH_NCCL_BLOCKING_WAIT=1 "Work WorkNCCL(...) timed out in blocking wait", and the
# watchdog's teardown "Some NCCL operations have failed or timed out".
TIMEOUT = re.compile(r"timed out|watchdog caught collective operation timeout|before timing out",
                     re.IGNORECASE)
# A peer that is gone. gloo: "Connection closed by peer", "Connection reset by peer".
# NCCL: ncclRemoteError's "remote process exited or there was a network error", and the
# communicator that the watchdog aborted after it: "NCCL communicator was aborted on rank 1."
PEER_GONE = re.compile(r"connection closed by peer|connection reset|remote process exited|ncclRemoteError|"
                       r"communicator was aborted|ProcessGroupNCCL is aborted", re.IGNORECASE)


def explain(err: BaseException, description: str) -> RuntimeError | None:
    """The clearer error for ``err`` raised by ``description`` ("recv(src=0, 4.0 KiB)"), or None."""
    msg = str(err).split("\nException raised from")[0].strip()
    if TIMEOUT.search(msg):
        return CommTimeout(f"{description} did not complete before the process-group timeout: "
                           f"no matching operation on the other side (a deadlock?)")
    if PEER_GONE.search(msg):
        return PeerGone(f"{description} failed: a peer rank exited (returned or crashed) before the "
                        f"matching call")
    return None
