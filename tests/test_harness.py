"""The harness itself: what a test's processes leave behind; its SSE parsing."""

from __future__ import annotations

import os

import pytest
from harness import MODEL, child_context, child_process, first_message, sse_chunk_events


@pytest.mark.slow
def test_a_node_killed_with_sigkill_leaves_no_temporary_directory_behind(procs):
    # A SIGKILLed process cannot remove what it made under the temporary directory
    # (multiprocessing's pymp-* folders); the harness gives each process its own and
    # removes it once the process is gone.
    node = procs.node("--model", MODEL, "--num-blocks", "64")
    tmp = node.tmpdir
    assert tmp is not None and tmp.is_dir()
    assert any(tmp.iterdir()), "the node made nothing in its temporary directory"
    node.kill9()
    assert not tmp.exists()


def _exit_at_once(conn, code: int) -> None:
    os._exit(code)


def _send_then_exit(conn, message: str) -> None:
    conn.send(message)


@pytest.mark.slow
def test_first_message_names_a_child_that_died_before_it_was_ready():
    # This process still holds the child's end of the pipe: no EOF tells it the child is
    # gone, only the child's own state does.
    parent, child = child_context().Pipe()
    proc = child_process(_exit_at_once, child, 3)
    proc.start()
    try:
        with pytest.raises(RuntimeError, match="the child exited with code 3 before it was ready"):
            first_message(parent, proc, 120, "the child")
    finally:
        proc.join(10)
    parent, child = child_context().Pipe()
    proc = child_process(_send_then_exit, child, "ready")
    proc.start()
    proc.join(30)  # sent, then exited: the message still counts
    assert first_message(parent, proc, 120, "the child") == "ready"


def test_sse_chunk_events_splits_the_stream_at_blank_lines_not_at_chunks():
    """A proxy chunk may hold two events (a chat stream's role chunk and P's token), and an
    event may arrive in two chunks: the events are the buffered stream's, not the chunks'."""
    chunks = [
        'data: {"a": 1}\n\ndata: {"b": 2}\n\n',  # two events in one chunk
        'data: {"c"',  # one event in two chunks
        ": 3}\n\n: a comment\n\ndata: [DONE]\n\n",
        'data: {"never": "ended"}\n',  # no blank line: not an event
    ]
    assert sse_chunk_events(chunks) == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert sse_chunk_events(['data: {"a": 1}\r\n\r\n']) == [{"a": 1}]
