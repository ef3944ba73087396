"""``pd-bench serve`` against a server whose stream goes silent mid-answer (or sends only
SSE comments): each wait for the stream's next event has ``--idle-timeout``, so such a
request is counted failed and the run ends. Before, the only bound was ``--timeout`` (a
request's whole time, vLLM's bench: 6 h), and each read's timeout was the same: a run
with a long ``--timeout`` waited that long on every stalled stream.

Real parts: the server is a stand-in HTTP/1.1 server on loopback in a thread
(``tests/standin_http.py``), the bench its real command in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from standin_http import SeenRequest, StandIn, answer

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = {"choices": [{"index": 0, "text": "a", "token_ids": [5], "finish_reason": None}]}

pytestmark = pytest.mark.timeout(120)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _stalling(comments: bool) -> Any:
    """A server answering ``/v1/models``, whose completions stream sends one token, then
    nothing (``comments``: an SSE comment every 50 ms) and never ends."""

    async def handler(req: SeenRequest) -> Any:
        if req.path == "/v1/models":
            return answer(200, {"object": "list", "data": [{"id": "tiny"}]})

        async def pieces() -> AsyncIterator[bytes]:
            yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            yield _chunk(f"data: {json.dumps(TOKEN)}\n\n".encode())
            while True:
                if comments:
                    yield _chunk(b": keep-alive\n\n")
                await asyncio.sleep(0.05)

        return pieces()

    return handler


@contextlib.contextmanager
def _serving(handler: Any) -> Iterator[str]:
    """``StandIn(handler)`` on its own event loop in a thread (the bench is a subprocess:
    the test's thread only waits); its URL."""
    loop = asyncio.new_event_loop()
    ready: list[str] = []
    stop = asyncio.Event()
    started = threading.Event()

    async def main() -> None:
        async with StandIn(handler) as node:
            ready.append(node.url)
            started.set()
            await stop.wait()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:  # connections still streaming: ended with the server
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("comments", [False, True], ids=["silent", "comments"])
def test_a_stream_that_stalls_mid_answer_fails_at_the_idle_timeout(
    comments: bool, tmp_path: Path
) -> None:
    out = tmp_path / "stalled.json"
    with _serving(_stalling(comments)) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "engine.bench", "serve", "--base-url", url,
             "--num-prompts", "2", "--input-len", "4", "--output-len", "4",
             "--num-warmup", "0", "--no-progress", "--json", str(out),
             "--timeout", "3600", "--idle-timeout", "1"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # nothing completed
    assert "Traceback" not in proc.stderr, proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 0 and s["failed"] == 2, s
    assert all("no event within 1 s" in msg for msg in s["errors"]), s["errors"]


def _slow_first_token(req: SeenRequest) -> Any:
    """Headers at once, the first event after 2 s (a queued request), then the rest."""
    if req.path == "/v1/models":
        return answer(200, {"object": "list", "data": [{"id": "tiny"}]})

    async def pieces() -> AsyncIterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        await asyncio.sleep(2.0)
        for _ in range(3):
            yield _chunk(f"data: {json.dumps(TOKEN)}\n\n".encode())
        yield _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    return pieces()


def test_the_wait_for_the_first_event_is_not_the_idle_timeouts(tmp_path: Path) -> None:
    """A loaded server may queue a request long before its first token: that wait is
    ``--timeout``'s, not ``--idle-timeout``'s."""

    async def handler(req: SeenRequest) -> Any:
        return _slow_first_token(req)

    out = tmp_path / "slow.json"
    with _serving(handler) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "engine.bench", "serve", "--base-url", url,
             "--num-prompts", "1", "--input-len", "4", "--output-len", "4",
             "--num-warmup", "0", "--no-progress", "--json", str(out),
             "--idle-timeout", "1"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 1 and s["failed"] == 0, s


def test_the_idle_timeout_must_be_positive_or_zero() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "serve", "--idle-timeout", "-1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--idle-timeout" in proc.stderr, proc.stderr
