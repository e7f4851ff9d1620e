"""Communication failures said in terms of the operation the user called.

A deadlock or a crashed peer surfaces as the backend's own wording, which names neither the
user's call nor the cause. :func:`explain` recognises that wording, gloo's and NCCL's, and
returns :class:`CommTimeout` ("nobody posted the other half") or :class:`PeerGone`
("the other side is no longer there"), which the launcher reports with the rank and line.

A line typed in a notebook is named by its cell (:func:`cell_title`): the function or class
the line is in, else the cell's first definition, else its first comment or line, so that
``notebook cell "ring_all_reduce", line 6`` says which of forty cells to open.
"""
from __future__ import annotations

import ast
import functools
import linecache
import re

from minidist.protocol import NOTEBOOK_CELL



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


@functools.lru_cache(maxsize=4096)       # a cell's file name changes with its source (ipykernel hashes it)
def cell_title(filename: str, line: int | None = None) -> str:
    """'notebook cell "ring_all_reduce"' for the cell compiled as ``filename`` (the kernel keeps its
    source in ``linecache``, which a forked rank inherits); plain 'notebook cell' without a source."""
    source = "".join(linecache.getlines(filename))
    title = ""
    try:
        defs = [n for n in ast.parse(source).body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    except (SyntaxError, ValueError):
        defs = []
    around = [n for n in defs if line is not None and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if around or defs:
        title = (around or defs)[0].name
    else:
        first = next((l.strip() for l in source.splitlines() if l.strip()), "")
        title = first.lstrip("#").strip() if first.startswith("#") else first
        title = title if len(title) <= 48 else title[:45] + "..."
    return f'notebook cell "{title}"' if title else "notebook cell"


def where_in_notebook(filename: str, line: int) -> str | None:
    """'notebook cell "ring_all_reduce", line 6' for a line typed in a notebook, else None."""
    return f"{cell_title(filename, line)}, line {line}" if NOTEBOOK_CELL.search(filename) else None
