"""The listening socket and the uvicorn server of a node or the proxy."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from types import FrameType
from typing import Any

from engine.httpkit.drain import Drainer
from engine.httpkit.http_protocol import uvicorn_http_options
from engine.httpkit.listen import bind_socket, listen_url

__all__ = ["bind_socket", "listen_url", "make_server"]


def make_server(
    app: Any,
    *,
    log_level: str,
    banner: str,
    lifespan: str = "auto",
    own_signals: bool = False,
    drainer: Drainer | None = None,
    graceful_shutdown_s: float = 5.0,
    uvicorn_log_level: str | None = None,
) -> Any:
    """A ``uvicorn.Server`` for ``app`` that prints ``banner`` once it serves.

    ``uvicorn_log_level`` (vLLM's ``--uvicorn-log-level``; default ``log_level``): the
    level of uvicorn's own loggers; at debug or trace every request line is logged.

    ``request_shutdown()`` (thread- and signal-safe) is what SIGTERM/SIGINT do: the first
    drains through ``drainer`` (if given) and then stops, a second stops at once.
    ``own_signals``: the caller installs the signal handlers itself and calls
    ``request_shutdown()``; uvicorn then installs none of its own.
    """
    import uvicorn

    level = (uvicorn_log_level or log_level).lower()
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=level,
        access_log=level in ("debug", "trace"),
        lifespan=lifespan,
        timeout_graceful_shutdown=graceful_shutdown_s,
        **uvicorn_http_options(),  # httptools when installed; the request head capped
    )

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if own_signals:
                yield
            else:
                with super().capture_signals():
                    yield

        def install_signal_handlers(self) -> None:  # uvicorn versions before capture_signals
            if not own_signals:
                super().install_signal_handlers()

        loop: asyncio.AbstractEventLoop | None = None

        def request_shutdown(self) -> None:
            if self.should_exit:
                self.force_exit = True
            elif drainer is None or drainer.draining or self.loop is None:
                self.should_exit = True
            else:
                self.loop.call_soon_threadsafe(drainer.start, self._drained)

        def _drained(self) -> None:
            self.should_exit = True

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.request_shutdown()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                print(banner, flush=True)  # noqa: T201 - CLI output

    return Server(config)
