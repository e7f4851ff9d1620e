"""Messages between the confirmation's parent and the child that runs the cells (standard library
and :mod:`minidist.protocol` only): a 4-byte length, then ``marshal`` data of plain values (dicts, lists, strings, numbers).

``marshal`` is used, not ``json``: its functions are C code that student code running in the child
cannot reroute (a patched ``json.encoder`` could rewrite a reply on its way out).
"""
import marshal
import os
import select
import time

from minidist.protocol import WIRE_MAX_BYTES as MAX_BYTES      # a test's reply: its docket and a few fields


_dumps, _loads, _write, _read = marshal.dumps, marshal.loads, os.write, os.read


def send(fd: int, obj) -> None:
    data = _dumps(obj)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[_write(fd, data):]


def recv(fd: int, timeout: float | None = None):
    """The next message, or None at the end of the stream, on a timeout, or on a malformed one."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def exactly(n):
        buf = bytearray()
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
            chunk = _read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exactly(4)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_BYTES:
        return None
    body = exactly(size)
    if body is None:
        return None
    try:
        return _loads(bytes(body))
    except (ValueError, EOFError, TypeError):
        return None
