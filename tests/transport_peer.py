"""The decode-side peer process of the transport tests (``test_nixl_transport.py``,
``test_ucxx_transport.py``): a child holding a transport over its own KV cache, driven by
the test through a side channel (its metadata, the notifications it got, its blocks,
adding a peer, sending a notification)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from harness import child_context, child_process, first_message

from kvconnector.nixl.side_channel import SideChannelServer


def block_bytes(kv: torch.Tensor, ids: list[int] | None = None) -> list[bytes]:
    """Each block's bytes (all blocks, or ``ids``)."""
    flat = kv.view(kv.shape[0], -1).view(torch.uint8)
    ids = list(range(kv.shape[0])) if ids is None else ids
    return [flat[i].numpy().tobytes() for i in ids]


def serve_peer(conn: Any, transport: Any, kv: torch.Tensor) -> None:
    """In the child: answer the test's side-channel requests about ``transport`` (over
    ``kv``) until the test says stop or goes away; then close both."""
    received: list[bytes] = []

    def handler(msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "meta":
            return {"ok": True, "meta": transport.metadata()}
        if op == "notifs":  # wait for at least msg["n"] notifs
            deadline = time.monotonic() + msg.get("wait", 5.0)
            while len(received) < msg["n"] and time.monotonic() < deadline:
                received.extend(transport.get_notifs())
                time.sleep(0.002)
            return {"ok": True, "notifs": list(received)}
        if op == "blocks":
            return {"ok": True, "blocks": block_bytes(kv)}
        if op == "add_peer":
            transport.add_peer(msg["key"], msg["meta"])
            return {"ok": True}
        if op == "send_notif":
            return {"ok": transport.send_notif(msg["key"], msg["msg"])}
        raise ValueError(f"unknown op {op}")

    # The handler runs on the server thread only, so the transport has one user thread.
    server = SideChannelServer("127.0.0.1", 0, handler)
    conn.send(server.address)
    with contextlib.suppress(EOFError):
        conn.recv()  # until the test says stop (or goes away)
    server.close()
    transport.close()


@contextlib.contextmanager
def peer_process(main: Callable[..., None], *args: Any) -> Iterator[tuple[Any, str, str]]:
    """Start ``main(conn, name, *args)`` in a child (it calls ``serve_peer``); yields the
    process, its agent name and its side-channel address. Always stops it (by its
    handle) on exit, even on failure or when the test stopped it with SIGSTOP."""
    parent, child = child_context().Pipe()
    name = f"D-{uuid.uuid4().hex[:8]}"
    proc = child_process(main, child, name, *args, daemon=True)
    proc.start()
    try:
        yield proc, name, first_message(parent, proc, 60, "the decode child")
    finally:
        if proc.is_alive():
            with contextlib.suppress(Exception):
                os.kill(proc.pid, signal.SIGCONT)
                parent.send("stop")
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        parent.close()
