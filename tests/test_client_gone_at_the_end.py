"""A client that goes away just as the engine ends its request by itself: one request, one
finish reason in the node's metrics.

The node (``build_app`` over a real ``AsyncLLMEngine`` on the ``tiny`` model, CPU, in this
process, served on a loopback socket) runs over an engine whose final output of a request,
once in the request's output stream, is taken from it only when its reader is cancelled
(fault injection: the race of a client's disconnect with the engine's own end, made
certain: the output waits unread as the node sees its client go). The engine has ended the
request by its length and counted it so in ``vllm:request_success_total``; the HTTP layer's
``pdserve_request_finished_total`` must say the same, not "abort" (docs/deploy.md, "What
each request counts").
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from harness import parse_metric, wait_for
from inproc_node import served, uni_config

from engine.async_engine import AsyncLLMEngine, _Stream
from engine.outputs import RequestOutput
from engine.server.app import build_app

MODEL = "tiny"
REASONS = ("stop", "length", "abort", "error")


def hold_final_outputs(held: threading.Event) -> Any:
    """``_Stream.get`` whose reader waits (until cancelled) once a finished output is next,
    setting ``held``."""

    async def get(stream: _Stream) -> Any:
        while not stream._items:
            stream._ready.clear()
            await stream._ready.wait()
        head = stream._items[0]
        if isinstance(head, RequestOutput) and head.finished:
            held.set()
            await asyncio.sleep(60)  # cancelled when the node sees the client gone
        return stream._items.popleft()

    return get


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[str, threading.Event]]:
    cfg = uni_config(MODEL, max_model_len=128, num_blocks=16)
    held = threading.Event()
    patch = pytest.MonkeyPatch()
    patch.setattr(_Stream, "get", hold_final_outputs(held))
    engine = AsyncLLMEngine(cfg, "WARNING")
    try:
        with served(build_app(engine, log_requests=False)) as url:
            yield url, held
    finally:
        engine.shutdown()
        patch.undo()


def finishes(url: str) -> dict[str, tuple[float, float]]:
    """Per finish reason: (the engine's count, the HTTP layer's)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        r: (
            parse_metric(text, "vllm:request_success_total", {"finished_reason": r}),
            parse_metric(text, "pdserve_request_finished_total", {"finish_reason": r}),
        )
        for r in REASONS
    }


def post_and_leave(url: str, body: dict[str, Any], held: threading.Event) -> None:
    """POST ``body``, and close the connection once the engine's end is held."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head.encode() + data)
        assert held.wait(30), "the request never ended in the engine"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", [None, ["never said"]])
def test_a_client_gone_as_the_engine_ends_counts_one_finish_reason(
    node: tuple[str, threading.Event], stream: bool, stop: list[str] | None
) -> None:
    """With and without stop strings (the engine counts a request with stop strings once
    the node says how it ended: here, an abort that finds it ended by its length)."""
    url, held = node
    held.clear()
    before = finishes(url)
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "ignore_eos": True,
            "temperature": 0, "stream": stream, "stop": stop}  # fmt: skip
    post_and_leave(url, body, held)

    def moved() -> dict[str, tuple[float, float]]:
        now = finishes(url)
        return {r: (now[r][0] - before[r][0], now[r][1] - before[r][1]) for r in REASONS}

    def both_counted() -> bool:
        d = moved()
        return sum(e for e, _ in d.values()) == 1 and sum(h for _, h in d.values()) == 1

    wait_for(both_counted, 30, "the engine and the HTTP layer to count the request")
    d = moved()
    assert d["length"] == (1, 1), d  # the engine ended it by its length, before the abort
