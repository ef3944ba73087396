"""A node's app in the test's own process, on a tiny model's real engine (``uni``
executor): on an event loop the test drives (``app_on_loop``), or served over real HTTP by
uvicorn in a thread (``served``).

For tests that need a node's whole HTTP stack but not a node process (its start-up, its
flags): metrics, detokenized answers, a client leaving as the engine ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

from harness import wait_for

from engine.async_engine import AsyncLLMEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.httpkit.serve import make_server
from engine.server.app import build_app


def uni_config(
    model: str = "tiny", max_model_len: int = 256, num_blocks: int = 64, block_size: int = 16
) -> EngineConfig:
    """A CPU engine's config in this process (``uni``: no worker processes)."""
    return EngineConfig(
        model=ModelConfig(model=model, max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        parallel=ParallelConfig(device="cpu", distributed_executor_backend="uni"),
    )


@contextlib.contextmanager
def app_on_loop(cfg: EngineConfig) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    """A node's app and one event loop for all its requests, kept open between them (the
    engine thread delivers a request's outputs to the loop it began on); shut down after."""
    engine = AsyncLLMEngine(cfg, "WARNING")
    loop = asyncio.new_event_loop()
    try:
        yield build_app(engine), loop
    finally:
        engine.shutdown()
        loop.close()


@contextlib.contextmanager
def served(app: Any, sock: socket.socket | None = None) -> Iterator[str]:
    """``app`` served on ``sock`` (default: a fresh one on 127.0.0.1, a free port) by uvicorn
    in a thread; yields its base URL. Stops the server and closes the socket after; the
    app's engine is the caller's."""
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
    srv = make_server(app, log_level="WARNING", banner="", own_signals=True)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        wait_for(lambda: srv.started, 60, "the node's server to start")
        host, port = sock.getsockname()[:2]
        yield f"http://{host}:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()
