"""``engine.executor.pipe_send``: messages a worker reads with ``recv_bytes``, and a
deadline when the pipe stays full."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from engine.executor.pipe_send import send_within, set_nonblocking


@pytest.mark.parametrize("size", [0, 1, 16384, 16385, 300_000])
def test_a_message_is_read_whole_by_recv_bytes(size: int) -> None:
    reader, writer = mp.Pipe(duplex=False)
    set_nonblocking(writer)
    data = bytes(i % 251 for i in range(size))
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(reader.recv_bytes()))
    t.start()
    try:
        assert send_within(writer, data, 60)
    finally:
        t.join(60)
        reader.close()
        writer.close()
    assert got == [data]


def test_a_full_pipe_nobody_reads_is_given_up_at_the_deadline() -> None:
    reader, writer = mp.Pipe(duplex=False)
    set_nonblocking(writer)
    try:
        assert not send_within(writer, b"x" * 1_000_000, 0.2)  # more than a pipe holds
    finally:
        reader.close()
        writer.close()


def test_a_pipe_whose_reader_is_gone_raises() -> None:
    reader, writer = mp.Pipe(duplex=False)
    set_nonblocking(writer)
    reader.close()
    try:
        with pytest.raises(BrokenPipeError):
            send_within(writer, b"step", 5)
    finally:
        writer.close()
