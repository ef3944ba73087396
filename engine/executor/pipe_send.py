"""Sending to a TP worker's task pipe with a deadline.

``Connection.send_bytes`` blocks until the whole message is in the pipe, which holds 64 KiB
on Linux: a step's message larger than that (a batch of prompts, penalties' prompt ids,
banned ids, grammar masks) to a worker that stopped reading (SIGSTOP, a hung device call)
blocked the engine thread for good, before ``--step-timeout`` could start counting.
``send_within`` writes the same bytes ``Connection.send_bytes`` would (the worker reads
them with ``recv_bytes``) to the pipe set non-blocking, and gives up at a deadline. A
message given up on is cut: nothing more may go down that pipe (the executor is dead).
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import time
from multiprocessing.connection import Connection


def frame_header(n: int) -> bytes:
    """``multiprocessing.connection.Connection``'s length prefix of an ``n``-byte message."""
    if n > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", n)
    return struct.pack("!i", n)


def set_nonblocking(conn: Connection) -> None:
    """From now on only ``send_within`` may write to ``conn``."""
    os.set_blocking(conn.fileno(), False)


def send_within(conn: Connection, data: bytes, timeout: float) -> bool:
    """Write one message to ``conn`` (non-blocking, ``set_nonblocking``) within ``timeout``
    seconds: True once it is all in the pipe, False when the deadline passed first (the
    message is cut). Raises ``OSError`` (``BrokenPipeError``) when the reader is gone."""
    fd = conn.fileno()
    deadline = time.monotonic() + timeout
    poller: select.poll | None = None  # only when the pipe is full
    header = frame_header(len(data))
    # One write for a small message (as ``send_bytes``), no copy of a large one.
    chunks = (header + data,) if len(data) <= 16384 else (header, data)
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            with contextlib.suppress(BlockingIOError):  # the pipe is full: wait below
                view = view[os.write(fd, view) :]
            if not view:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
            poller.poll(max(1, int(left * 1000)))
    return True
